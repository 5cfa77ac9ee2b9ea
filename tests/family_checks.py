"""Checks every model-family test repeats, written once: build a model the way the trainer does,
run it forward and backward, split it into pipeline stages, move its weights to Hugging Face and
back, and run checks on spawned gloo ranks.

Imported like tests/conftest.py and tests/faults.py (``from family_checks import ...``): pytest puts
tests/ on sys.path (a file that torchrun runs as a script puts tests/ on PYTHONPATH itself). The
checks assert; tolerances are the caller's (atol arguments) or torch's defaults where the tests
used those before.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from conftest import REPO
from titanlike.parallel.pipeline import PipelineLayout, build_stage_modules

# ---------------------------------------------------------------- building and sizing


def materialize(model_cls, args, seed: int = 0, device: str = "cpu") -> torch.nn.Module:
    """The trainer's sequence: construction on meta, to_empty, init_weights."""
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=seed)
    return model


def import_hf_folder(spec, folder) -> torch.nn.Module:
    """A family's model from a transformers folder, through its HF adapter (config, then weights), in eval
    mode: what a checkpoint.initial_load_in_hf job loads."""
    from titanlike.checkpoint.hf import read_hf

    hf_sd, config = read_hf(str(folder))
    args = spec.hf.read_config(config)
    model = materialize(spec.model_cls, args, seed=1).eval()
    model.load_state_dict(spec.hf.from_hf_state_dict(hf_sd, args))
    return model


def check_greedy_equals_hf(ours: torch.nn.Module, hf, prompts: list[list[int]], new_tokens: int = 8) -> None:
    """Our engine's greedy tokens for the prompts, decoded in one batch (rows of their own lengths), equal
    transformers' generate on each prompt alone (hf made with pad_token_id 0)."""
    from titanlike.inference import Engine, SamplingParams

    completions, _ = Engine(ours).generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    for prompt, completion in zip(prompts, completions):
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        assert completion.tokens == want[0, len(prompt):].tolist()


def held_params(model: torch.nn.Module) -> int:
    """Parameters a module holds (a tied Parameter once)."""
    return sum(p.numel() for p in model.parameters())


def token_batch(vocab_size: int, seq: int, seed: int, batch: int = 2) -> torch.Tensor:
    """Random token ids, the same for a given seed."""
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def probe_tokens(vocab_size: int, seq: int = 40) -> torch.Tensor:
    """What the Hugging Face interchange tests feed both models: 2 sequences of 40 tokens."""
    return token_batch(vocab_size, seq, seed=1)


# ---------------------------------------------------------------- a causal LM's forward and backward


def check_forward_backward(model: torch.nn.Module, vocab_size: int, seq: int = 16) -> torch.Tensor:
    """Logits of shape (batch, seq, vocab) in train mode, and a gradient for every parameter.
    Returns the tokens it fed."""
    model.train()
    tokens = token_batch(vocab_size, seq, seed=0)
    logits = model(tokens)
    assert logits.shape == (*tokens.shape, vocab_size)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    return tokens


def check_causal(model: torch.nn.Module, tokens: torch.Tensor, vocab_size: int, prefix: int = 10) -> None:
    """Changing the tokens after `prefix` leaves the logits of the first `prefix` positions unchanged."""
    model.eval()
    with torch.no_grad():
        changed = tokens.clone()
        changed[:, prefix:] = (changed[:, prefix:] + 1) % vocab_size
        torch.testing.assert_close(model(tokens)[:, :prefix], model(changed)[:, :prefix])


# ---------------------------------------------------------------- pipeline split


def init_pipeline_stages(full: torch.nn.Module, spec, layout: PipelineLayout, seed: int) -> dict[int, torch.nn.Module]:
    """Every stage of a meta model's split, materialized and initialized with `seed` as the trainer
    does on each pipeline rank; keyed by stage index."""
    parts = {}
    for rank in range(layout.pp):
        for stage, part in zip(layout.stages_of_rank(rank), build_stage_modules(full, spec, layout, rank)):
            part.to_empty(device="cpu")
            part.init_weights(seed=seed)
            parts[stage] = part
    return parts


def check_stages_initialized_as_full(parts: dict[int, torch.nn.Module], full: torch.nn.Module, seed: int) -> None:
    """Every stage's parameters equal, bit for bit, the same-named ones of the meta model `full`
    once materialized and initialized with `seed` (a tied table under each of its names)."""
    full.to_empty(device="cpu")
    full.init_weights(seed=seed)
    full_params = dict(full.named_parameters(remove_duplicate=False))
    for part in parts.values():
        for name, param in part.named_parameters():
            assert torch.equal(param, full_params[name]), name


def run_stages(parts: dict[int, torch.nn.Module], inputs: torch.Tensor, **fields) -> torch.Tensor:
    """The stages applied in order, as the schedule chains them; every stage gets every field."""
    h = inputs
    for stage in range(len(parts)):
        h = parts[stage](h, **fields)
    return h


# ---------------------------------------------------------------- Hugging Face interchange, both ways


def _conversion_scripts():
    """scripts/convert_hf_to_dcp.py and convert_dcp_to_hf.py, imported as users run them."""
    scripts = str(REPO / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import convert_dcp_to_hf
    import convert_hf_to_dcp

    return convert_hf_to_dcp, convert_dcp_to_hf


def check_hf_import(hf, hf_folder: Path, dcp_folder: Path, family: str, tokens: torch.Tensor,
                    atol: float) -> torch.Tensor:
    """save_pretrained -> convert_hf_to_dcp.py -> titanlike.load_model gives the HF model's logits,
    and so does load_model on the HF folder itself; the DCP's sidecar names `family`. Returns the
    HF logits."""
    import titanlike

    to_dcp, _ = _conversion_scripts()
    hf.save_pretrained(hf_folder)
    with torch.no_grad():
        want = hf(tokens).logits
    assert to_dcp.main([str(hf_folder), str(dcp_folder)]) == 0
    assert json.loads((dcp_folder / "titanlike.json").read_text())["model"]["name"] == family
    with torch.no_grad():
        torch.testing.assert_close(titanlike.load_model(dcp_folder)(tokens), want, rtol=0, atol=atol)
        torch.testing.assert_close(titanlike.load_model(hf_folder)(tokens), want, rtol=0, atol=atol)
    return want


def first_batch_and_hf_loss(hf, tokenizer, seq_len: int = 64, batch: int = 8) -> tuple[torch.Tensor, float]:
    """The first batch train.py's default dataset gives one process (data seed 0), and the HF
    model's cross-entropy on it: what a job that starts from hf's weights must log first."""
    from titanlike.data import build_dataloader

    first = next(iter(build_dataloader(
        dataset="default", dataset_path=None, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=batch,
        global_batch_size=batch, dp_rank=0, dp_degree=1, seed=0)))
    inputs, labels = first["inputs"], first["labels"]
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(inputs).logits.flatten(0, 1), labels.flatten()).item()
    return inputs, hf_loss


def write_model_only_dcp(model: torch.nn.Module, family: str, args, folder: Path) -> None:
    """A model-only DCP of `model`'s weights, as the trainer's final save writes it."""
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model

    write_dcp_model(model.state_dict(), str(folder),
                    {"contents": "model_only", "step": 0, "model": model_description(family, args)})


def check_hf_export(dcp_folder: Path, hf_folder: Path, hf_cls, tokens: torch.Tensor, want: torch.Tensor,
                    atol: float, convert_args: tuple[str, ...] = (), **from_pretrained) -> None:
    """convert_dcp_to_hf.py (with convert_args), then transformers' hf_cls.from_pretrained
    (with from_pretrained) gives the logits `want`."""
    _, to_hf = _conversion_scripts()
    assert to_hf.main([str(dcp_folder), str(hf_folder), *convert_args]) == 0
    back = hf_cls.from_pretrained(hf_folder, **from_pretrained).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, want, rtol=0, atol=atol)


# ---------------------------------------------------------------- checks on spawned gloo ranks


def _gloo_rank(rank: int, init_file: str, world: int, checks: Callable[[int], None]) -> None:
    torch.set_num_threads(1)  # ranks share 2 cores; oversubscription makes gloo crawl
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        checks(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_on_gloo_ranks(checks: Callable[[int], None], world: int, timeout_s: float, what: str) -> None:
    """Run checks(rank) on `world` spawned processes joined in one gloo group. `checks` must be a
    module-level function (spawn pickles it by name). A failing rank fails the test with its
    traceback (join raises ProcessRaisedException); ranks still running after timeout_s fail it too."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_gloo_rank, args=(os.path.join(tmp, "store"), world, checks), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} did not finish within {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()


# ---------------------------------------------------------------- a family's job, planned and fed as the trainer does


def family_flavors(*, debug_only: bool = False) -> list[tuple[str, str]]:
    """(family, flavor) of every registered family (the toy family of tests/toy_family.py included:
    tests/conftest.py registers it). debug_only: the flavors a test materializes, each family's
    smallest and its other debug-sized ones (their structure differs: DeepSeek's query without LoRA,
    the hybrid's MoE and pure Mamba-2 patterns)."""
    from titanlike.models.registry import get_model_spec, model_names

    out = []
    for name in model_names():
        spec = get_model_spec(name)
        smallest = min(spec.flavors, key=lambda f: spec.flavors[f].num_params())
        out += [(name, f) for f in spec.flavors if not debug_only or f == smallest or f.startswith("debug")]
    return out


def structure(spec, args) -> frozenset:
    """What a flavor's model is made of, sizes aside: (module path with layer numbers as N, class) of
    every module, and the optional parameters it leaves None."""
    import re

    with torch.device("meta"):
        model = spec.model_cls(args)
    parts = set()
    for name, module in model.named_modules():
        path = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1N", name)
        parts.add((path, type(module).__name__))
        parts.update((path, f"{attr}=None") for attr, p in module._parameters.items() if p is None)
    return frozenset(parts)


def distinct_flavors(*, min_layers: int = 0) -> list[tuple[str, str]]:
    """Of family_flavors(debug_only=True), the smallest flavor of each distinct structure (llama's
    debugmodel builds what its debugmodel_tiny builds, only wider): what the materialized checks run.
    min_layers: prefer flavors with at least this many trunk layers (a pipeline split into 4 stages)."""
    from titanlike.models.registry import get_model_spec

    chosen: dict[tuple[str, frozenset], str] = {}
    for name, flavor in family_flavors(debug_only=True):
        spec = get_model_spec(name)
        args = spec.flavors[flavor]
        key = (name, structure(spec, args))
        best = chosen.get(key)
        rank = lambda a: (a.num_layers < min_layers, a.num_params())  # noqa: E731
        if best is None or rank(args) < rank(spec.flavors[best]):
            chosen[key] = flavor
    return sorted((name, flavor) for (name, _), flavor in chosen.items())


SEQ = 32  # what the materialized checks feed: long enough for every family's chunks and rules


def plan_family(family: str, flavor: str, *extra: str, world_size: int = 1, seq_len: int = SEQ,
                local_batch_size: int = 2):
    """plan_job of a tiny fp32 job of this family and flavor (the job's tokenizer sizes the model)."""
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    cfg = load_job_config(["--model.name", family, "--model.flavor", flavor, "--training.seq_len", str(seq_len),
                           "--training.local_batch_size", str(local_batch_size),
                           "--training.mixed_precision_param", "float32", *extra])
    return plan_job(cfg, world_size)


def loader_batch(plan, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """The first global batch train.py's data loader gives one process for this plan (its objective's
    samples of the embedded corpus): a dict of named tensors."""
    from titanlike.data import build_dataloader

    t = plan.cfg.training
    return next(iter(build_dataloader(
        dataset=t.dataset, dataset_path=t.dataset_path, tokenizer=plan.tokenizer, seq_len=t.seq_len,
        local_batch_size=batch, global_batch_size=batch, dp_rank=0, dp_degree=1, seed=seed,
        objective=plan.objective)))


def microbatch(plan, batch: dict[str, torch.Tensor], cp_positions: torch.Tensor | None = None):
    """What the trainer hands the model and the loss for this loader batch (objective.prepare)."""
    from titanlike.objectives.base import BatchContext

    ctx = BatchContext(torch.device("cpu"), cp_positions=cp_positions, mask_kernel=None if cp_positions is not None
                       else "sdpa", eos_id=plan.tokenizer.eos_id, lookahead_tokens=plan.model_args.lookahead_tokens)
    return plan.objective.prepare(batch, ctx)


def logits_of(output) -> torch.Tensor:
    """A forward's logits (a ModelOutput carries auxiliary losses beside them)."""
    from titanlike.models.outputs import ModelOutput

    return output.logits if isinstance(output, ModelOutput) else output
