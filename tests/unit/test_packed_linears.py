"""The eager engine's linear layers on a CPU run through oneDNN with prepacked weights
(titanlike/inference/packed.py):

- what it computes equals F.linear within float32's rounding (fp32 and bf16, 2-D and 3-D inputs);
- the engine's prefill and decode step use it (the profiler sees oneDNN's op, not aten::mm, for the
  model's layers), and its tokens and log-probabilities are those of an unpacked forward;
- training is untouched: with autograd recording, inside a torch.compile trace, or after the
  engine's call, a layer is plain F.linear again (outputs equal bit for bit, gradients flow);
- a pack follows the weights: an update torch's fused AdamW makes (which the version counter does not
  count) is seen by the next generate call;
- only plain CPU nn.Linear layers of at least 256 x 256 are packed (a LoRA layer keeps its own forward;
  smaller layers are faster through MKL);
- the compiled engine packs nothing (inductor traces the modules).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from family_checks import materialize
from titanlike.inference import Engine, SamplingParams
from titanlike.inference.engine import uncached_logits
from titanlike.inference.packed import MIN_PACKED_WEIGHT, PackedLinears
from titanlike.models.outputs import logits_of
from titanlike.models.registry import get_model_spec

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _model(seed: int = 0):
    """dim 256 (layers of at least 256 x 256 are packed: MIN_PACKED_WEIGHT), 2 layers, 256 tokens."""
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=256, n_layers=2, max_seq_len=40)
    return materialize(spec.model_cls, args, seed=seed).eval()


def _op_names(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 256), (16, 256), (3, 5, 256)])
def test_the_packed_product_equals_f_linear(dtype, shape):
    torch.manual_seed(0)
    layer = nn.Linear(256, 288, bias=True).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    packed = PackedLinears(layer)
    assert packed.modules == [layer]
    with torch.no_grad(), packed:
        got = layer(x)
    want = F.linear(x, layer.weight, layer.bias)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tolerance)
    assert "forward" not in layer.__dict__  # the module's own forward again


def test_the_engine_decodes_through_the_packed_layers_and_gets_the_unpacked_tokens():
    model = _model()
    engine = Engine(model)
    big = [m for m in model.modules() if type(m) is nn.Linear and m.weight.numel() >= MIN_PACKED_WEIGHT]
    assert engine.packed and engine.packed.modules == big and len(big) >= 2 * 4  # wq, wo and the MLP's, per layer
    prompts = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90]]
    params = SamplingParams(max_new_tokens=8, logprobs=True)
    names = _op_names(lambda: engine.generate(prompts, params))
    assert "mkldnn::_linear_pointwise" in names
    completions, _ = engine.generate(prompts, params)
    for prompt, c in zip(prompts, completions):
        logits = uncached_logits(model, prompt, c.tokens[:-1])  # grad enabled: plain F.linear
        assert c.tokens == logits.argmax(-1).tolist()
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)
    # Outside the engine's calls, a layer is nn.Linear's own forward.
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_training_keeps_f_linear_bit_for_bit_and_its_gradients():
    torch.manual_seed(0)
    layer = nn.Linear(256, 256)
    x = torch.randn(4, 256)
    packed = PackedLinears(layer)
    with packed:  # autograd recording: the packed product would not carry gradients
        y = layer(x)
        names = _op_names(lambda: layer(x))
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias)) and y.requires_grad
    assert "mkldnn::_linear_pointwise" not in names
    y.sum().backward()
    assert layer.weight.grad is not None

    graphs = []

    def backend(graph, inputs):  # records what dynamo traced (inductor would compile this graph)
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(lambda t: layer(t).relu(), backend=backend)
    with torch.no_grad(), packed:  # traced: the compiler's own matmul, no oneDNN tensor in the graph
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias).relu())
    targets = {str(node.target) for graph in graphs for node in graph.graph.nodes}
    assert graphs and not any("mkldnn" in t for t in targets), targets


def test_a_generate_call_sees_weights_fused_adamw_changed():
    """torch's fused AdamW does not bump the parameters' version counter: a pack keyed on it alone
    would decode with the old weights (the GRPO mismatch of tests/unit/test_grpo_objective.py)."""
    model = _model()
    engine = Engine(model)
    prompt = [[5, 9, 17, 3, 44, 12, 8]]
    params = SamplingParams(max_new_tokens=6, logprobs=True)
    engine.generate(prompt, params)  # packs the weights as they are
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    versions = [p._version for p in model.parameters()]
    model.train()
    F.cross_entropy(logits_of(model(torch.tensor(prompt)))[0], torch.tensor(prompt[0])).backward()
    optimizer.step()
    model.eval()
    assert versions == [p._version for p in model.parameters()]  # the premise: the counter did not move
    (c,), _ = engine.generate(prompt, params)
    logits = uncached_logits(model, prompt[0], c.tokens[:-1])
    assert c.tokens == logits.argmax(-1).tolist()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=1e-5, rtol=0)


def test_only_plain_cpu_linear_layers_are_packed():
    from titanlike.models.lora import LoRALinear

    plain = nn.Linear(256, 256)
    lora = LoRALinear.__new__(LoRALinear)
    nn.Linear.__init__(lora, 256, 256)
    half = nn.Linear(256, 256).half()  # oneDNN's packed fp16 product is not what F.linear computes on CPU
    small = nn.Linear(256, 255)  # below MIN_PACKED_WEIGHT: MKL's product is faster there
    model = nn.Sequential(plain, lora, half, small)
    assert PackedLinears(model).modules == [plain]


def test_the_compiled_engine_packs_nothing():
    assert Engine(_model(), compile=True).packed is None
