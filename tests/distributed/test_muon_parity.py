"""Distributed Muon (titanlike/train/muon.py) steps as one process does, on spawned gloo ranks.

- 2 ranks, FSDP2 (fully_shard per block, then the root) over the tiny Llama: every parameter after each of 4
  steps equals the one-process optimizer's on the same gradients within 1e-5 (relative), with
  float32 states and QK-clip (train/qk_clip.py: the maxima reduced over the ranks, the local rows
  scaled); with bfloat16 states within 5e-2 (each rank rounds its shard with its own random bits,
  so the runs agree only in distribution, and Newton-Schulz normalises away the scale of the update,
  not its direction's rounding noise: 2.5e-2 measured after 4 steps at lr 0.01; a shard stepped with
  the wrong piece of the update is off by order 1).
- 4 ranks, one world: every placement the orthogonalisation handles, on a toy block: a matrix sharded
  along its rows (gathered to an owner) and along its columns (TP's row-wise split), a 3-D stack of
  experts split by expert (EP: whole matrices on each rank, nothing moves) and along a matrix
  dimension, a matrix replicated along one mesh dimension and sharded along the other (HSDP:
  gathered within the shard group) and a matrix sharded along two mesh dimensions (gathered once over
  both); then the tiny Llama planned as the trainer plans it under FSDP 2 x TP 2 (every block matrix
  split along both dimensions, strided FSDP shards included: each orthogonalised once, the owners on
  all four ranks; QK-clip's reduction and each rank's heads' rows, and the same rows of DeepSeek-V3's
  MLA, with and without its low-rank query) and under PP 2 x FSDP 2 (each
  stage steps its own matrices), fed the same gradients as one process.
The Newton-Schulz input is rounded to bfloat16 by torch's own iteration, so the pieces travel as
bfloat16 and the result is the same bits: the tolerance covers the elementwise steps' float32 sums.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from family_checks import run_on_gloo_ranks

pytestmark = pytest.mark.distributed

RTOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _assert_same(got: nn.Module, want: nn.Module, what: str, rtol: float = RTOL) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        a = _full(a.detach())
        err = ((a - b).norm() / b.norm().clamp(min=1e-12)).item()
        assert err <= rtol, f"{what}: {name} differs by {err:.2e} (relative)"


def _fsdp_checks(rank: int) -> None:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titanlike.config import load_job_config
    from titanlike.models.llama3 import Transformer, llama3_flavors
    from titanlike.train.optimizer import build_optimizer

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=320, max_seq_len=16)
    mesh = init_device_mesh("cpu", (2,))
    from titanlike.train.qk_clip import QKClip

    for dtype in ("float32", "bfloat16"):
        cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.lr", "0.01", "--optimizer.state_dtype",
                               dtype, "--optimizer.implementation", "for-loop"]).optimizer
        models = []
        for shard in (False, True):
            with torch.device("meta"):
                model = Transformer(args)
            if shard:
                for block in model.layers.values():
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            model.to_empty(device="cpu")
            model.init_weights(seed=0)
            models.append(model)
        one, fsdp = models
        optimizers = [build_optimizer([m], cfg) for m in models]
        # QK-clip with float32 states, at a threshold some heads' logits of these steps cross (0.06 to 0.1).
        clips = [QKClip([one], 0.08), QKClip([fsdp], 0.08, data_mesh=mesh)] if dtype == "float32" else []
        for step in range(4):
            tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
            for model in models:
                # The same batch on both ranks: FSDP's averaged gradient is the one-process gradient.
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            for o in optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            maxima = [c.apply(torch.tensor(True)) for c in clips]
            if clips:
                torch.testing.assert_close(maxima[1], maxima[0], rtol=RTOL, atol=0)
            _assert_same(fsdp, one, f"FSDP2 {dtype} states{' and QK-clip' if clips else ''}, step {step}")
        if clips:
            assert (maxima[0] > 0.08).any(), maxima[0]  # the clip acted


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.randn(7, 12))      # uneven rows over 2 ranks
        self.cols = nn.Parameter(torch.randn(10, 6))
        self.experts = nn.Parameter(torch.randn(4, 6, 5))
        self.experts_rows = nn.Parameter(torch.randn(3, 9, 4))
        self.two_dims = nn.Parameter(torch.randn(8, 6))
        self.hsdp = nn.Parameter(torch.randn(5, 6))
        self.norm = nn.Parameter(torch.ones(6))


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block()})


def _placement_checks() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from titanlike.config import load_job_config
    from titanlike.train.optimizer import build_optimizer

    flat, grid = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    replicated = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    placed = {"rows": (flat, [Shard(0)]), "cols": (flat, [Shard(1)]), "experts": (flat, [Shard(0)]),
              "experts_rows": (flat, [Shard(1)]), "two_dims": (grid, [Shard(0), Shard(1)]),
              "hsdp": (replicated, [Replicate(), Shard(0)])}
    cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--optimizer.implementation",
                           "for-loop"]).optimizer
    torch.manual_seed(0)
    one = _Toy()
    sharded = _Toy()
    sharded.load_state_dict(one.state_dict())
    block = sharded.layers["0"]
    for name, (mesh, placements) in placed.items():
        setattr(block, name, nn.Parameter(distribute_tensor(getattr(block, name).data, mesh, placements)))
    optimizers = [build_optimizer([m], cfg) for m in (one, sharded)]
    assert {id(p) for p in optimizers[1].param_groups[0]["params"]} == \
        {id(getattr(block, n)) for n in placed}  # every matrix is Muon's, the norm AdamW's
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for name, p in one.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
            q = sharded.get_parameter(name)
            q.grad = distribute_tensor(p.grad, q.device_mesh, q.placements) if name.split(".")[-1] in placed \
                else p.grad.clone()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        _assert_same(sharded, one, f"placements, step {step}")


def _layout(*parallelism: str, family: str = "llama3", flavor: str = "debugmodel_tiny"):
    """(plan, this rank's model parts, the one-process model) of a tiny model (the Llama unless told)
    under a 4-rank layout."""
    from family_checks import plan_family
    from titanlike.models.converters import build_model_converters
    from titanlike.train.model_parts import build_model_parts

    plan = plan_family(family, flavor, "--optimizer.name", "Muon", "--optimizer.lr", "0.02",
                       "--optimizer.implementation", "for-loop", *parallelism, world_size=4)
    plan.dims.build_mesh("cpu")
    parts = build_model_parts(plan, build_model_converters([], plan.cfg))
    with torch.device("meta"):
        one = plan.spec.model_cls(plan.model_args)
    for model in (*parts, one):
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
    return plan, parts, one


def _same_by_name(parts, one: nn.Module, what: str) -> None:
    for part in parts:
        for name, a in part.named_parameters():
            b = one.get_parameter(name)
            err = ((_full(a.detach()) - b).norm() / b.norm().clamp(min=1e-12)).item()
            assert err <= RTOL, f"{what}: {name} differs by {err:.2e} (relative)"


def _steps_as_one_process(plan, parts, one, what: str, steps: int = 2) -> None:
    """Muon over this rank's parts and over the one-process model, fed the same gradients (each rank
    its pieces), step after step."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titanlike.train.optimizer import build_optimizer

    optimizers = [build_optimizer(parts, plan.cfg.optimizer), build_optimizer([one], plan.cfg.optimizer)]
    _same_by_name(parts, one, f"{what}, initial weights")
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for name, p in one.named_parameters():
            p.grad = torch.randn(p.shape, generator=g)
        for part in parts:
            for name, q in part.named_parameters():
                full = one.get_parameter(name).grad
                q.grad = distribute_tensor(full, q.device_mesh, q.placements, src_data_rank=None) \
                    if isinstance(q, DTensor) else full.clone()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        _same_by_name(parts, one, f"{what}, step {step}")


def _fsdp_tp_checks() -> None:
    """FSDP 2 x TP 2: every block matrix is split along both; each is gathered once to one owner,
    the owners spread over all four ranks; QK-clip scales the local rows of each rank's heads."""
    import titanlike.train.muon as muon

    plan, parts, one = _layout("--parallelism.data_parallel_shard_degree", "2",
                               "--parallelism.tensor_parallel_degree", "2")
    owned, ns = [], muon.newton_schulz
    muon.newton_schulz = lambda u, **kw: (owned.append(tuple(u.shape)), ns(u, **kw))[1]
    try:
        _steps_as_one_process(plan, parts, one, "FSDP x TP")
    finally:
        muon.newton_schulz = ns
    # Each rank's orthogonalisations, less the one-process optimizer's (every matrix, each step):
    # every matrix once a step, on some rank, and every rank owns some.
    matrices = sum(p.ndim == 2 for n, p in one.named_parameters() if n.startswith("layers."))
    mine = torch.tensor([len(owned) - 2 * matrices])
    counts = [torch.zeros(1, dtype=mine.dtype) for _ in range(4)]
    dist.all_gather(counts, mine)
    assert sum(c.item() for c in counts) == 2 * matrices and min(c.item() for c in counts) > 0, counts
    _clips_as_one_process(plan, parts, one, "QK-clip under FSDP x TP")


def _clips_as_one_process(plan, parts, one, what: str) -> None:
    """QK-clip over this rank's parts and over the one-process model: per-head maxima, the largest on
    the first data-parallel rank, the heads split by tp; the clipped weights must agree."""
    from titanlike.train.qk_clip import QKClip

    dims, tau = plan.dims, 1.0
    clips = [QKClip(parts, tau, data_mesh=dims.mesh("loss"), tp_mesh=dims.mesh("tp")), QKClip([one], tau)]
    assert clips[1].layers and len(clips[0].layers) == len(clips[1].layers)
    tp_rank, dp_rank = dims.mesh("tp").get_local_rank(), dims.dp_rank()
    for (_, mine), (_, theirs) in zip(clips[0].layers, clips[1].layers):
        maxima = torch.rand(theirs.logit_max.shape, generator=torch.Generator().manual_seed(7)) * 2
        theirs.logit_max.copy_(maxima)
        heads = mine.logit_max.numel()
        mine.logit_max.copy_(maxima[tp_rank * heads:(tp_rank + 1) * heads] - dp_rank)
    got, want = (c.apply(torch.tensor(True)) for c in clips)
    torch.testing.assert_close(got, want)
    _same_by_name(parts, one, what)


def _mla_clip_checks() -> None:
    """DeepSeek-V3's MLA under FSDP 2 x TP 2, with and without the low-rank query: each rank scales
    its local rows of wq / wq_b and wkv_b by the Kimi K2 rule as one process does."""
    for flavor in ("debugmodel", "debugmodel_nolora"):
        plan, parts, one = _layout("--parallelism.data_parallel_shard_degree", "2",
                                   "--parallelism.tensor_parallel_degree", "2", family="deepseek_v3", flavor=flavor)
        _clips_as_one_process(plan, parts, one, f"MLA's QK-clip under FSDP x TP ({flavor})")


def _pp_checks() -> None:
    """PP 2 x FSDP 2: each stage steps its own matrices, gathered within the stage's FSDP group."""
    plan, parts, one = _layout("--parallelism.data_parallel_shard_degree", "2",
                               "--parallelism.pipeline_parallel_degree", "2")
    _steps_as_one_process(plan, parts, one, "PP x FSDP")


def _four_rank_checks(rank: int) -> None:
    _placement_checks()
    _fsdp_tp_checks()
    _mla_clip_checks()
    _pp_checks()


def test_fsdp2_muon_steps_as_one_process():
    run_on_gloo_ranks(_fsdp_checks, 2, 600, "distributed Muon under FSDP2")


def test_every_placement_and_layout_steps_as_one_process():
    run_on_gloo_ranks(_four_rank_checks, 4, 600, "distributed Muon's placements, FSDP x TP and PP")
