"""ParallelDims: degrees, the dense mesh views and the expert views (ep, efsdp, expert_fsdp), built
in one process on torch's fake process group so every rank's view can be checked."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.parallel.utils import clip_grad_norm_


def views(rank: int, world: int, **degrees) -> dict[str, list]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        dims = ParallelDims.resolve(world_size=world, **degrees)
        dims.build_mesh("cpu")
        return {name: (None if dims.mesh(name) is None else dims.mesh(name).mesh.tolist())
                for name in ("fsdp", "tp", "ep", "efsdp", "expert_fsdp")}
    finally:
        dist.destroy_process_group()


def test_expert_views_recut_the_dense_ranks_with_ep_innermost():
    # 8 ranks: replicate 2 x shard 2 x tp 2, ep 2 -> efsdp = 2 x 2 / 2 = 2.
    v0 = views(0, 8, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    assert v0["tp"] == [0, 1] and v0["ep"] == [0, 1]
    assert v0["efsdp"] == [0, 2]
    assert v0["expert_fsdp"] == [[0, 2], [4, 6]]  # replicated over dp_replicate, sharded over efsdp
    v5 = views(5, 8, dp_replicate=2, dp_shard=2, tp=2, ep=2)
    assert v5["ep"] == [4, 5] and v5["efsdp"] == [5, 7] and v5["expert_fsdp"] == [[1, 3], [5, 7]]
    # ep spanning all of dp_shard x tp: no expert sharding left, experts replicated over dp_replicate only.
    v = views(3, 8, dp_replicate=2, dp_shard=2, tp=2, ep=4)
    assert v["ep"] == [0, 1, 2, 3] and v["efsdp"] is None and v["expert_fsdp"] == [[3], [7]]
    # Without replication or experts-to-shard there is no expert FSDP mesh at all.
    v = views(1, 4, dp_shard=4, ep=4)
    assert v["ep"] == [0, 1, 2, 3] and v["efsdp"] is None and v["expert_fsdp"] is None
    assert views(0, 4, dp_shard=4)["ep"] is None


def test_expert_degree_must_divide_the_ranks_it_spans():
    assert ParallelDims.resolve(world_size=8, dp_shard=4, tp=2, ep=8).efsdp == 1
    with pytest.raises(ValueError, match="expert_parallel_degree 3 must divide data_parallel_shard_degree 4 x "
                                         "context_parallel_degree 1 x tensor_parallel_degree 2 = 8"):
        ParallelDims.resolve(world_size=8, dp_shard=4, tp=2, ep=3)


def test_clip_grad_norm_over_parameters_on_several_meshes():
    # Dense and expert parameters live on different meshes; one DTensor op cannot take both. The
    # total norm must still be the norm over all of them, and every gradient is clipped by it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dense_mesh = DeviceMesh("cpu", [0], mesh_dim_names=("fsdp",))
        expert_mesh = DeviceMesh("cpu", [0], mesh_dim_names=("ep",))
        g = torch.Generator().manual_seed(0)
        grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]
        params = []
        for grad, mesh, placement in zip(grads, (dense_mesh, expert_mesh, None), (Shard(0), Replicate(), None)):
            p = torch.nn.Parameter(torch.zeros_like(grad))
            if mesh is not None:
                p = torch.nn.Parameter(distribute_tensor(p.data, mesh, [placement]))
                p.grad = distribute_tensor(grad.clone(), mesh, [placement])
            else:
                p.grad = grad.clone()
            params.append(p)
        expected = torch.cat([t.flatten() for t in grads]).norm()
        norm = clip_grad_norm_(params, max_norm=1.0)
        torch.testing.assert_close(norm.total, expected)
        assert norm.nonfinite_param() is None
        scale = 1.0 / (expected + 1e-6)
        for p, grad in zip(params, grads):
            local = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            torch.testing.assert_close(local, grad * scale)
        # A parameter named in `exclude` (a tied copy counted elsewhere) is clipped but not counted.
        for p, grad in zip(params, grads):
            p.grad = distribute_tensor(grad.clone(), p.device_mesh, p.placements) if hasattr(p, "device_mesh") else grad.clone()
        norm = clip_grad_norm_(params, max_norm=1e9, exclude=frozenset({id(params[1])}))
        torch.testing.assert_close(norm.total, torch.cat([grads[0].flatten(), grads[2].flatten()]).norm())
        # A non-finite gradient makes the norm non-finite, leaves the gradients unclipped, and is located.
        params[2].grad[0, 1] = float("inf")
        norm = clip_grad_norm_(params, max_norm=1.0)
        assert not norm.total.isfinite() and norm.nonfinite_param() == 2
        torch.testing.assert_close(params[2].grad[1], grads[2][1])
    finally:
        dist.destroy_process_group()
