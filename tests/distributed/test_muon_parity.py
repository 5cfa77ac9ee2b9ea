"""Distributed Muon (titanlike/train/muon.py) steps as one process does, on 2 spawned gloo ranks.

- FSDP2 (fully_shard per block, then the root) over the tiny Llama: every parameter after each of 4
  steps equals the one-process optimizer's on the same gradients within 1e-5 (relative), with
  float32 states; with bfloat16 states within 5e-2 (each rank rounds its shard with its own random bits,
  so the runs agree only in distribution, and Newton-Schulz normalises away the scale of the update,
  not its direction's rounding noise: 2.5e-2 measured after 4 steps at lr 0.01; a shard stepped with
  the wrong piece of the update is off by order 1).
- Every placement the orthogonalisation handles, on a toy block: a matrix sharded along its rows
  (gathered to an owner) and along its columns (TP's row-wise split), a 3-D stack of experts split by
  expert (EP: whole matrices on each rank, nothing moves) and along a matrix dimension, a matrix
  replicated along one mesh dimension and sharded along the other (HSDP: gathered within the shard
  group) and a matrix sharded along two mesh dimensions (assembled on every rank).
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
    for dtype, rtol in (("float32", RTOL), ("bfloat16", 5e-2)):
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
        for step in range(4):
            tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(step))
            for model in models:
                # The same batch on both ranks: FSDP's averaged gradient is the one-process gradient.
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
            for o in optimizers:
                o.step()
                o.zero_grad(set_to_none=True)
            _assert_same(fsdp, one, f"FSDP2 {dtype} states, step {step}", rtol)


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


def _placement_checks(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from titanlike.config import load_job_config
    from titanlike.train.optimizer import build_optimizer

    flat, grid = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    replicated = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
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


def test_fsdp2_muon_steps_as_one_process():
    run_on_gloo_ranks(_fsdp_checks, 2, 600, "distributed Muon under FSDP2")


def test_every_placement_steps_as_one_process():
    run_on_gloo_ranks(_placement_checks, 2, 300, "distributed Muon's placements")
