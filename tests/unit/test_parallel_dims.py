"""ParallelDims: degrees, the dense mesh views and the expert views (ep, etp, experts, efsdp,
expert_fsdp), built in one process on torch's fake process group so every rank's view can be checked;
and the expert placements parallel/expert_parallel.py gives over them."""

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
                for name in ("fsdp", "tp", "ep", "etp", "experts", "efsdp", "expert_fsdp")}
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


def test_expert_tensor_parallel_ranks_are_innermost_and_match_tp_when_equal():
    # 8 ranks: replicate 2 x shard 2 x tp 2, ep 2 x etp 2: the etp group is the tp group, ep steps over it.
    v0 = views(0, 8, dp_replicate=2, dp_shard=2, tp=2, ep=2, etp=2)
    assert v0["etp"] == v0["tp"] == [0, 1] and v0["ep"] == [0, 2] and v0["experts"] == [[0, 1], [2, 3]]
    assert v0["efsdp"] is None and v0["expert_fsdp"] == [[0], [4]]  # replicated over dp_replicate only
    # shard 4 x tp 2, ep 2 x etp 2: 2 ranks left to FSDP-shard each set of expert slices.
    v6 = views(6, 8, dp_shard=4, tp=2, ep=2, etp=2)
    assert v6["etp"] == [6, 7] and v6["ep"] == [4, 6] and v6["efsdp"] == [2, 6] and v6["expert_fsdp"] == [2, 6]
    # etp without ep: the experts' mesh is the etp ranks.
    v = views(3, 4, dp_shard=4, etp=2)
    assert v["ep"] is None and v["etp"] == v["experts"] == [2, 3] and v["efsdp"] == [1, 3]


def test_expert_tensor_parallelism_splits_the_hidden_units_and_wraps_the_dispatcher():
    from titanlike.models.common.moe import MoE, MoEArgs
    from titanlike.parallel.expert_parallel import AllToAllDispatcher, ExpertTensorParallel, apply_expert_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
    try:
        dims = ParallelDims.resolve(world_size=8, dp_shard=4, tp=2, ep=2, etp=2)
        dims.build_mesh("cpu", experts=True)
        with torch.device("meta"):
            layer = MoE(16, MoEArgs(num_experts=4, top_k=2, hidden_dim=32))
        apply_expert_parallel(layer, ep_mesh=dims.mesh("ep"), sequence_mesh=dims.mesh("sequence"),
                              etp_mesh=dims.mesh("etp"), experts_mesh=dims.mesh("experts"))
        w1, w2 = layer.experts.w1, layer.experts.w2
        assert w1.placements == (Shard(0), Shard(1)) and w2.placements == (Shard(0), Shard(2))
        assert w1.to_local().shape == (2, 16, 16) and w2.to_local().shape == (2, 16, 16)
        assert isinstance(layer.dispatcher, ExpertTensorParallel)
        assert isinstance(layer.dispatcher.inner, AllToAllDispatcher) and layer.dispatcher.etp == 2
    finally:
        dist.destroy_process_group()


def test_expert_degree_must_divide_the_ranks_it_spans():
    assert ParallelDims.resolve(world_size=8, dp_shard=4, tp=2, ep=8).efsdp == 1
    with pytest.raises(ValueError, match="expert_parallel_degree 3 must divide data_parallel_shard_degree 4 x "
                                         "context_parallel_degree 1 x tensor_parallel_degree 2 = 8"):
        ParallelDims.resolve(world_size=8, dp_shard=4, tp=2, ep=3)
    with pytest.raises(ValueError, match="expert_parallel_degree 2 x expert_tensor_parallel_degree 4 = 8 must divide "
                                         "data_parallel_shard_degree 2 x "):
        ParallelDims.resolve(world_size=4, dp_shard=2, tp=2, ep=2, etp=4)
    with pytest.raises(ValueError, match="expert_tensor_parallel_degree must be at least 1, got 0"):
        ParallelDims.resolve(world_size=4, etp=0)


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
