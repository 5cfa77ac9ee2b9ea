"""KV-cache generation under tensor parallelism equals one process: one spawned gloo world of 2 ranks
runs, for every family that generates and has a sharding plan (its smallest debug flavor, vocabulary
256), the engine on the model sharded by the family's plan (gathered logits, no sequence
parallelism: a decode step holds one token per row) and on the same weights in one process, on one
batch of prompts of different lengths. Greedy tokens must be equal, also when rows end early and the
sharded engine compacts its cache, and the cached logits of the prefill and of each teacher-forced
decode step within 1e-4 (the caches hold this rank's heads only; the latent of multi-head latent
attention is replicated).

The same world runs the lm-evaluation-harness model under TP2 (tests/lm_eval_assets.py: a checkpoint,
local tasks, the responses one process gives for the first document of each), so one spawn serves
both (tests/integration/test_lm_eval.py compares one process with lm-eval's hf model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import toy_family  # noqa: F401  (the spawned ranks register the same families)
from family_checks import run_on_gloo_ranks
from lm_eval_assets import TP_LIMIT, build_assets, evaluate, offline, prepare_tp_checks, responses, tp_checks
from titanlike.models import protocol
from titanlike.models.registry import get_model_spec, model_names

pytestmark = pytest.mark.distributed

PROMPTS = [[5, 9, 17, 3, 44, 12, 8], [7, 31, 90], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 3]]
NEW_TOKENS = 4


def _families() -> list[tuple[str, str]]:
    out = []
    for name in model_names():
        spec = get_model_spec(name)
        flavor = min(spec.flavors, key=lambda f: spec.flavors[f].num_params())
        with torch.device("meta"):
            generates = protocol.generation_hooks(spec.model_cls(spec.flavors[flavor])) is not None
        if generates and spec.shard is not None:
            out.append((name, flavor))
    return out


def _cached_logits(model, tokens: list[list[int]]) -> torch.Tensor:
    init_cache, prefill, decode_step = protocol.generation_hooks(model)
    lengths = torch.tensor([len(p) for p in PROMPTS])
    padded = torch.zeros(len(PROMPTS), int(lengths.max()), dtype=torch.long)
    for row, p in enumerate(PROMPTS):
        padded[row, :len(p)] = torch.tensor(p)
    cache = init_cache(len(PROMPTS), padded.shape[1] + NEW_TOKENS, device="cpu", dtype=torch.float32)
    out = [prefill(padded, lengths, cache)]
    for step in range(NEW_TOKENS - 1):
        out.append(decode_step(torch.tensor([row[step] for row in tokens]), cache))
    return torch.stack(out, 1)


def _checks(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from titanlike.inference import Engine, SamplingParams
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,))
    for family, flavor in _families():
        spec = get_model_spec(family)
        args = spec.flavors[flavor]
        # A vision-language model's vocabulary is its language model's: sized as the trainer sizes it.
        args = (dataclasses.replace(args, vocab_size=256) if "vocab_size" in {f.name for f in dataclasses.fields(args)}
                else args.update_from_config(vocab_size=256, seq_len=args.context_len))
        models = []
        for sharded in (False, True):
            with torch.device("meta"):
                model = spec.model_cls(args)
            if sharded:
                apply_tensor_parallel(model, mesh, spec.shard, loss_parallel=False, sequence_parallel=False)
            model.to_empty(device="cpu")
            model.init_weights(seed=0)
            models.append(model.eval())
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        one, tp = ([c.tokens for c in Engine(m).generate(PROMPTS, params)[0]] for m in models)
        assert tp == one, f"{family}: TP2 generated {tp}, one process {one}"
        # Rows 0 and 1 end within 2 tokens: the sharded engine goes on in a cache of row 2 alone (copy_row
        # of this rank's heads), one process without compaction.
        ending = dataclasses.replace(params, stop_token_ids={one[0][1], one[1][1]})
        rows = []
        engine = Engine(models[1])
        real = engine.decode_step
        engine.decode_step = lambda tokens, cache: rows.append(cache.batch_size) or real(tokens, cache)
        compacted = [c.tokens for c in engine.generate(PROMPTS, ending)[0]]
        every = [c.tokens for c in Engine(models[0], compact=False).generate(PROMPTS, ending)[0]]
        assert compacted == every and rows[-1] == 1, \
            f"{family}: TP2 compacted generated {compacted} ({rows}), one process {every}"
        torch.testing.assert_close(_cached_logits(models[1], one), _cached_logits(models[0], one), rtol=0, atol=1e-4,
                                   msg=lambda m: f"{family}: {m}")
    tp_checks(rank)


def test_generation_and_lm_eval_under_tp2_equal_one_process(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    assert {"llama3", "deepseek_v3", "hybrid", "t5"} <= {f for f, _ in _families()}
    offline(monkeypatch)
    assets = build_assets(tmp_path, hf=False)
    one = evaluate("titanlike", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}", assets["tasks"], limit=TP_LIMIT)
    prepare_tp_checks(assets, responses(one), tmp_path, monkeypatch)
    run_on_gloo_ranks(_checks, world=2, timeout_s=400, what="generation and lm-eval under TP2")
