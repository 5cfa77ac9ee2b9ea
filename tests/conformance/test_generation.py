"""KV-cache generation (titanlike/inference) for every registered family that generates, checked once
per family against transformers on the Hugging Face export of the same weights.

For each family whose model carries the generation hooks (models/protocol.py) and whose flavor has
a transformers class, a tiny random model (its smallest debug flavor of each distinct structure,
vocabulary 256, width 128, at most 2 decoder layers) is written with the library's Hugging Face writer and loaded with
`from_pretrained`; then, on one batch of three prompts of different lengths:
- greedy continuations of the engine (one batch, per-row lengths) equal transformers' `generate`
  (one batch, left-padded with an attention mask) token for token;
- teacher-forced on those tokens, the cached logits (prefill, then one decode step per token) equal
  the uncached forward over the whole sequence within 1e-4 (fp32), row by row; so do those of a
  static cache (a compiled step's), whose decode steps keep its tensors where they are, used
  twice;
- continuous batching on two slots (the third prompt refills the slot of the first, which ends
  early: the family's cache copies a row) gives each prompt the same tokens.
An encoder-only model is refused in one sentence.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from family_checks import distinct_flavors, materialize
from titanlike.inference import ContinuousBatch, Engine, GenerationError, SamplingParams
from titanlike.models import protocol
from titanlike.models.registry import get_model_spec

VOCAB = 256
NEW_TOKENS = 6
PROMPT_LENGTHS = (7, 3, 12)


def _generating_flavors() -> list[tuple[str, str]]:
    out = []
    for family, flavor in distinct_flavors():
        spec = get_model_spec(family)
        with torch.device("meta"):
            generates = protocol.generation_hooks(spec.model_cls(spec.flavors[flavor])) is not None
        if not generates or spec.hf is None:
            continue
        try:
            spec.hf.args_to_config(spec.flavors[flavor])
        except ValueError:  # a flavor no transformers class computes
            continue
        out.append((family, flavor))
    return out


FLAVORS = _generating_flavors()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    # Ids from 3 up: 0..2 are the pad, BOS and EOS ids some exports name.
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _model_and_export(family: str, flavor: str, tmp_path):
    transformers = pytest.importorskip("transformers")
    from titanlike.checkpoint.hf import write_hf

    spec = get_model_spec(family)
    flavor_args = spec.flavors[flavor]
    # A composed model (llava) sizes its vocabulary through its language model's args.
    args = _shortened(dataclasses.replace(flavor_args, vocab_size=VOCAB) if hasattr(flavor_args, "__dataclass_fields__")
                      and "vocab_size" in flavor_args.__dataclass_fields__ else
                      flavor_args.update_from_config(vocab_size=VOCAB, seq_len=flavor_args.context_len))
    model = materialize(spec.model_cls, args, seed=0).eval()
    # No EOS in config.json: transformers would stop a row there and we compare fixed lengths. Pad 0
    # is T5's decoder start token (HF's decoder_start_token_id).
    write_hf(model.state_dict(), spec, args, str(tmp_path), pad_id=0)
    config = json.loads((tmp_path / "config.json").read_text())
    hf = getattr(transformers, config["architectures"][0]).from_pretrained(tmp_path).eval()
    return model, hf


def _shortened(args):
    """Width 128 and at most 2 decoder layers (a dense and an MoE one where the flavor has a dense
    first layer), or 3 of a long hybrid pattern: the structure is the flavor's, the time a few seconds."""
    fields = {f.name for f in dataclasses.fields(args)}
    changes = {"dim": 128} if "dim" in fields and args.dim > 128 else {}
    if "n_layers" in fields and args.n_layers > 2:
        changes["n_layers"] = 2
    if "hybrid_layer_pattern" in fields and len(args.hybrid_layer_pattern) > 6:
        changes["hybrid_layer_pattern"] = args.hybrid_layer_pattern[:3]
    return dataclasses.replace(args, **changes)


def _hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    attention = torch.zeros_like(ids)
    encoder_decoder = hf.config.is_encoder_decoder
    for row, p in enumerate(prompts):
        # Left padding for a decoder (its new tokens follow the last column); right for an encoder.
        where = slice(0, len(p)) if encoder_decoder else slice(longest - len(p), longest)
        ids[row, where], attention[row, where] = torch.tensor(p), 1
    out = hf.generate(input_ids=ids, attention_mask=attention, max_new_tokens=NEW_TOKENS, do_sample=False,
                      pad_token_id=0)
    return out[:, 1 if encoder_decoder else longest:].tolist()


def _addresses(cache) -> dict[tuple[str, str, str], int]:
    """Where each tensor a cache holds lives: (entry, attribute) -> data pointer."""
    return {where: value.data_ptr() for where, value in cache.held_tensors().items()}


def _uncached(model, prompt: list[int], new: list[int], encoder_decoder: bool) -> torch.Tensor:
    """Logits (len(new) + 1, vocab) of the token after the prompt and each prefix of `new`, from full
    forwards (decoder-only: the prompt and the new tokens as one sequence; T5: the prompt to the
    encoder, the start token and the new tokens to the decoder)."""
    from titanlike.models.outputs import logits_of

    with torch.no_grad():
        if encoder_decoder:
            return logits_of(model(torch.tensor([prompt]), decoder_inputs=torch.tensor([[0] + new])))[0]
        return logits_of(model(torch.tensor([prompt + new])))[0, len(prompt) - 1:]


@pytest.mark.parametrize("family,flavor", FLAVORS)
def test_greedy_generation_equals_transformers_and_the_cache_equals_the_full_forward(family, flavor, tmp_path):
    model, hf = _model_and_export(family, flavor, tmp_path)
    prompts = _prompts()
    completions, stats = Engine(model).generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))
    ours = [c.tokens for c in completions]
    assert ours == _hf_greedy(hf, prompts), family
    assert all(c.finish_reason == "length" for c in completions) and stats.new_tokens == 3 * NEW_TOKENS

    # The same batch teacher-forced through the cache, against full forwards row by row.
    init_cache, prefill, decode_step = protocol.generation_hooks(model)
    lengths = torch.tensor(PROMPT_LENGTHS)
    padded = torch.zeros(len(prompts), max(PROMPT_LENGTHS), dtype=torch.long)
    for row, p in enumerate(prompts):
        padded[row, :len(p)] = torch.tensor(p)

    def teacher_forced(cache) -> torch.Tensor:  # (batch, steps, vocab)
        cached = [prefill(padded, lengths, cache)]
        held = _addresses(cache)
        for step in range(NEW_TOKENS - 1):
            cached.append(decode_step(torch.tensor([row[step] for row in ours]), cache))
        # A static cache's decode steps write in place (a CUDA graph of the step reads and writes its
        # state at the addresses it was recorded with).
        assert not cache.static or _addresses(cache) == held, family
        return torch.stack(cached, dim=1)

    cached = teacher_forced(init_cache(len(prompts), max(PROMPT_LENGTHS) + NEW_TOKENS, device="cpu",
                                       dtype=torch.float32))
    for row, p in enumerate(prompts):
        want = _uncached(model, p, ours[row][:-1], hf.config.is_encoder_decoder)
        torch.testing.assert_close(cached[row], want, rtol=0, atol=1e-4)
    # The compiled engine's cache: static (every slot read, past a row's length masked), reused by
    # the next call (its prefill rewrites what the call reads): the same logits both times.
    static = init_cache(len(prompts), max(PROMPT_LENGTHS) + NEW_TOKENS + 4, device="cpu", dtype=torch.float32)
    static.static = True
    for _ in range(2):
        torch.testing.assert_close(teacher_forced(static), cached, rtol=0, atol=1e-5)

    batch = ContinuousBatch(Engine(model), slots=2)
    lengths = (2, NEW_TOKENS, NEW_TOKENS)
    seqs = [batch.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    batch.run()
    assert [s.completion.tokens for s in seqs] == [row[:n] for row, n in zip(ours, lengths)], family
    assert seqs[2].slot == seqs[0].slot
    # A row that ends with none waiting takes the last row's sequence (moved with copy_row), the step
    # runs on the rows in use only (ModelCache.head), and a static cache's reads a length bucket; a
    # static cache whose shapes are still compiling (ready: none yet) is stepped eager on a head that
    # is not static (continuous.py compile_in_background).
    for static, ready in ((False, None), (True, None), (True, set())):
        batch = ContinuousBatch(Engine(model), slots=3)
        batch.cache.static, batch.ready = static, ready
        lengths = (2, 3, NEW_TOKENS)
        seqs = [batch.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        batch.run()
        assert [s.completion.tokens for s in seqs] == [row[:n] for row, n in zip(ours, lengths)], (family, static)
        assert seqs[2].slot == 0
        assert batch.compiled_steps == (batch.steps if static and ready is None else 0)


def test_every_generating_family_is_checked():
    """The families with a Hugging Face adapter that generate are all in FLAVORS (a family that lost
    its hooks, or whose flavors all lost their transformers class, would silently drop out)."""
    checked = {family for family, _ in FLAVORS}
    assert {"llama3", "gpt2", "qwen3", "mixtral", "deepseek_v3", "hybrid", "t5", "llava"} <= checked, checked


def test_an_encoder_only_model_is_refused_in_one_sentence():
    spec = get_model_spec("bert")
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors["debugmodel_tiny"])
    with pytest.raises(GenerationError) as e:
        Engine(model)
    message = str(e.value)
    assert "cannot generate" in message and "encoder-only" in message and "\n" not in message
