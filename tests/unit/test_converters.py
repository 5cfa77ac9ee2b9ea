"""Model converters (titanlike/models/converters.py): which linears the float8 and Transformer
Engine swaps touch, the emulated float8 forward/backward, the post-step scale hook, the float8
tensor-parallel styles, and every validation rule. End-to-end runs: tests/distributed/test_float8.py."""

from __future__ import annotations

import dataclasses
import logging
import sys
import types

import pytest
import torch
import torch.nn as nn

from titanlike.config import ConfigError, load_job_config
from titanlike.train.plan import plan_job
from titanlike.models.converters import (
    build_model_converters,
    fqn_matches,
    is_float8_tensorwise_linear,
)
from titanlike.models.registry import get_model_spec

pytest.importorskip("torchao")


def converters_of(cfg):
    return build_model_converters(cfg.model.converters, cfg)


def float8_cfg(*argv: str):
    return load_job_config(["--model.converters", "float8", "--float8.emulate", *argv])


def meta_llama(flavor: str = "debugmodel", **changes):
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=64, **changes)
    with torch.device("meta"):
        return spec.model_cls(args)


def linear_types(model: nn.Module) -> dict[str, str]:
    return {fqn: type(m).__name__ for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}


# --- which linears become Float8Linear ---------------------------------------------------------


def test_float8_swaps_every_block_linear_but_not_the_output(caplog):
    model = meta_llama()
    with caplog.at_level(logging.INFO, logger="titanlike"):
        converters_of(float8_cfg()).convert(model)
    types_ = linear_types(model)
    assert types_.pop("output") == "Linear"
    assert len(types_) == 8 * 7 and set(types_.values()) == {"Float8Linear"}
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("float8")]
    assert messages == ["float8 (tensorwise, emulated): converted 56 of 57 linear layers; "
                        "left in high precision: output (float8.filter_fqns)"]


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128, bias=False)
        self.odd = nn.Linear(128, 24, bias=False)  # 24 output features: not a multiple of 16
        self.odd_in = nn.Linear(40, 64)  # 40 input features
        self.layers = nn.ModuleDict({str(i): nn.Linear(64, 64) for i in (1, 10)})
        self.output = nn.Linear(64, 32)


def test_float8_skips_linears_whose_features_are_not_multiples_of_16(caplog):
    model = Toy()
    with caplog.at_level(logging.INFO, logger="titanlike"):
        converters = converters_of(float8_cfg())
        converters.convert(model)
    assert linear_types(model) == {"up": "Float8Linear", "odd": "Linear", "odd_in": "Linear",
                                   "layers.1": "Float8Linear", "layers.10": "Float8Linear", "output": "Linear"}
    selection = converters.converters[0].selection
    assert (selection.converted, selection.filtered, selection.misaligned) == (
        ["up", "layers.1", "layers.10"], ["output"], ["odd", "odd_in"])
    assert ("converted 3 of 6 linear layers; left in high precision: output (float8.filter_fqns), "
            "odd, odd_in (features not multiples of 16)") in caplog.text


def test_float8_filter_fqns_match_whole_name_parts():
    model = Toy()
    converters_of(float8_cfg("--float8.filter_fqns", "layers.1")).convert(model)
    types_ = linear_types(model)
    # "layers.1" names layer 1, not layer 10; an empty-but-set list no longer protects the output.
    assert (types_["layers.1"], types_["layers.10"], types_["output"]) == ("Linear", "Float8Linear", "Float8Linear")

    model = meta_llama()
    converters_of(float8_cfg("--float8.filter_fqns", "attention.wq,output")).convert(model)
    types_ = linear_types(model)
    assert {t for fqn, t in types_.items() if fqn.endswith("attention.wq")} == {"Linear"}
    assert {t for fqn, t in types_.items() if fqn.endswith("attention.wk")} == {"Float8Linear"}
    assert fqn_matches("layers.3.attention.wq", "wq") and not fqn_matches("layers.3.attention.wqx", "wq")


def test_float8_recipes_and_fsdp_all_gather_weights():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = meta_llama()
    converters_of(float8_cfg("--float8.enable_fsdp_float8_all_gather")).convert(model)
    wq = model.layers["0"].attention.wq
    assert isinstance(wq.weight, WeightWithDynamicFloat8CastTensor) and wq.config.emulate
    assert is_float8_tensorwise_linear(wq)

    model = meta_llama()
    converters_of(float8_cfg("--float8.recipe_name", "rowwise")).convert(model)
    wq = model.layers["0"].attention.wq
    assert type(wq).__name__ == "Float8Linear" and not is_float8_tensorwise_linear(wq)
    assert not isinstance(wq.weight, WeightWithDynamicFloat8CastTensor)


# --- the emulated float8 path ------------------------------------------------------------------


def test_emulated_float8_forward_backward_is_close_to_high_precision_and_not_equal():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128, bias=False), nn.GELU(), nn.Linear(128, 64, bias=False))
    f8 = nn.Sequential(*[type(m)(m.in_features, m.out_features, bias=False) if isinstance(m, nn.Linear) else m
                         for m in ref])
    f8.load_state_dict(ref.state_dict())
    converters_of(float8_cfg()).convert(f8)
    assert type(f8[0]).__name__ == "Float8Linear"
    x = torch.randn(8, 16, 64)
    y_ref, y_f8 = ref(x), f8(x)
    y_ref.square().mean().backward()
    y_f8.square().mean().backward()
    # e4m3 keeps 3 mantissa bits: relative errors of a few percent, never bit-equal.
    rel = (y_f8 - y_ref).norm() / y_ref.norm()
    assert 1e-4 < rel < 0.1, rel
    for a, b in zip(ref.parameters(), f8.parameters()):
        grad_rel = (b.grad - a.grad).norm() / a.grad.norm()
        assert 1e-4 < grad_rel < 0.1, grad_rel


def test_precompute_scales_runs_after_each_step_only_when_asked(monkeypatch):
    import torchao.float8 as float8

    calls = []
    monkeypatch.setattr(float8, "precompute_float8_dynamic_scale_for_fsdp", calls.append)
    parts = [nn.Linear(16, 16), nn.Linear(16, 16)]
    converters_of(float8_cfg()).post_optimizer_step(parts)
    assert calls == []
    converters_of(float8_cfg("--float8.enable_fsdp_float8_all_gather",
                                      "--float8.precompute_float8_dynamic_scale_for_fsdp")).post_optimizer_step(parts)
    assert calls == parts


# --- tensor parallel styles --------------------------------------------------------------------


def _block_styles(model):
    from titanlike.models.registry import ShardOptions

    block, table = model.layers["0"], get_model_spec("llama3").shard.block
    opts = ShardOptions(loss_parallel=True, sequence_parallel=True)
    return tuple(type(table[name](block.get_submodule(name), opts)).__name__
                 for name in ("attention.wq", "attention.wo", "attention", "feed_forward"))


def test_tensor_parallel_plan_uses_float8_styles_for_tensorwise_float8_linears():
    model = meta_llama()
    assert _block_styles(model) == ("ColwiseParallel", "RowwiseParallel", "PrepareModuleInput", "PrepareModuleInput")
    converters_of(float8_cfg()).convert(model)
    assert _block_styles(model) == ("Float8ColwiseParallel", "Float8RowwiseParallel",
                                    "PrepareFloat8ModuleInput", "PrepareFloat8ModuleInput")
    # Rowwise keeps the high-precision all-gathers (as torchtitan does).
    model = meta_llama()
    converters_of(float8_cfg("--float8.recipe_name", "rowwise")).convert(model)
    assert _block_styles(model) == ("ColwiseParallel", "RowwiseParallel", "PrepareModuleInput", "PrepareModuleInput")
    # An input read by a linear left in high precision is not cast to float8 before its all-gather.
    model = meta_llama()
    converters_of(float8_cfg("--float8.filter_fqns", "output,wk")).convert(model)
    assert _block_styles(model) == ("Float8ColwiseParallel", "Float8RowwiseParallel",
                                    "PrepareModuleInput", "PrepareFloat8ModuleInput")


# --- Transformer Engine (a stand-in module: TE needs CUDA and cannot be installed here) ---------


@pytest.fixture
def fake_transformer_engine(monkeypatch):
    events = []

    class Linear(nn.Linear):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__(in_features, out_features, bias=bias, dtype=params_dtype, device=device)

        def forward(self, x):
            events.append("linear")
            return super().forward(x)

    class fp8_autocast:
        def __init__(self, enabled=True):
            self.enabled = enabled

        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")

    te = types.ModuleType("transformer_engine")
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    te_pytorch.Linear, te_pytorch.fp8_autocast = Linear, fp8_autocast
    te.pytorch = te_pytorch
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pytorch)
    return types.SimpleNamespace(Linear=Linear, events=events)


def test_te_swaps_the_same_linears_copies_weights_and_runs_forward_under_fp8_autocast(fake_transformer_engine):
    torch.manual_seed(0)
    model = Toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 64)
    expected = model.layers["1"](model.up(x)[:, :64])
    converters_of(load_job_config(["--model.converters", "te"])).convert(model)
    assert {fqn for fqn, m in model.named_modules() if isinstance(m, fake_transformer_engine.Linear)} == {
        "up", "layers.1", "layers.10"}
    assert type(model.output) is nn.Linear and type(model.odd) is nn.Linear
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)

    class Root(nn.Module):  # the model part the trainer calls: its forward runs under the autocast
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner.layers["1"](self.inner.up(x)[:, :64])

    root = Root(Toy())
    root.inner.load_state_dict(before)
    converters_of(load_job_config(["--model.converters", "te"])).convert(root)
    fake_transformer_engine.events.clear()
    torch.testing.assert_close(root(x), expected)
    assert fake_transformer_engine.events == ["enter", "linear", "linear", "exit"]


def test_te_converter_works_on_the_meta_model(fake_transformer_engine):
    model = meta_llama()
    converters_of(load_job_config(["--model.converters", "te"])).convert(model)
    wq = model.layers["0"].attention.wq
    assert isinstance(wq, fake_transformer_engine.Linear) and wq.weight.is_meta
    assert type(model.output) is nn.Linear


# --- validation ------------------------------------------------------------------------------

NO_FLOAT8_GPU = not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))


def refusal(argv: list[str], world: int = 1) -> str:
    cfg = load_job_config(argv)
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=world)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unknown_converter_lists_known_ones():
    assert refusal(["--model.converters", "float8,fp4"]) == \
        "model.converters names an unknown converter 'fp4'; known converters: float8, lora, mx, te"


@pytest.mark.skipif(not NO_FLOAT8_GPU, reason="the refusal is for machines without an SM 8.9+ GPU")
def test_float8_without_emulate_needs_a_float8_gpu():
    message = refusal(["--model.converters", "float8"])
    assert message.startswith("float8 needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090)")
    assert message.endswith("set float8.emulate to test the swap on CPU")


@pytest.mark.parametrize("argv, fragment", [
    (["--float8.recipe_name", "rowwise", "--float8.enable_fsdp_float8_all_gather"],
     "float8.enable_fsdp_float8_all_gather works with the tensorwise recipe only"),
    (["--float8.precompute_float8_dynamic_scale_for_fsdp"],
     "float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of the float8 all-gather, "
     "so it needs float8.enable_fsdp_float8_all_gather"),
    (["--float8.recipe_name", "blockwise"], "float8.recipe_name must be tensorwise or rowwise"),
    (["--model.converters", "float8,float8"], "names a converter twice"),
    (["--model.converters", "float8,te"], "float8 and te both replace the linear layers"),
])
def test_float8_option_rules(argv, fragment):
    assert fragment in refusal(["--model.converters", "float8", "--float8.emulate", *argv])


def test_float8_without_torchao_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    assert "needs torchao, which is not installed: pip install torchao" in refusal(
        ["--model.converters", "float8", "--float8.emulate"])


def test_te_rules(monkeypatch, fake_transformer_engine):
    if NO_FLOAT8_GPU:
        assert "model.converters te needs a CUDA GPU with compute capability 8.9+" in refusal(
            ["--model.converters", "te"])
    else:
        assert "does not work with tensor parallelism" in refusal(
            ["--model.converters", "te", "--parallelism.tensor_parallel_degree", "2"], world=2)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    assert "needs NVIDIA Transformer Engine, which is not installed" in refusal(["--model.converters", "te"])


def test_valid_float8_configs_pass():
    plan_job(float8_cfg("--float8.enable_fsdp_float8_all_gather",
                               "--float8.precompute_float8_dynamic_scale_for_fsdp"), world_size=2).dims
    plan_job(float8_cfg("--float8.recipe_name", "rowwise",
                               "--parallelism.tensor_parallel_degree", "2"), world_size=2).dims


@pytest.mark.skipif(not NO_FLOAT8_GPU, reason="the refusal is for machines without an SM 8.9+ GPU")
def test_train_py_refuses_float8_on_this_machine_in_one_sentence():
    from conftest import train_here

    proc = train_here(["--model.converters", "float8", "--training.steps", "1"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: float8 needs a CUDA GPU with compute capability 8.9+ (H100/L40/4090), but this machine "
        "has none; set float8.emulate to test the swap on CPU"]
