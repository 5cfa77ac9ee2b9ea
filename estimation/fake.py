"""What running a training step on fake tensors needs: a fake process group, a count of the bytes
the step's tensors hold, values where routing reads them, CUDA's attention kernels on a CPU build,
and compiled graphs as inductor would allocate them.

The device. Fake tensors are CPU tensors (a CPU-only torch cannot make CUDA ones); for a GPU
estimate (device "cuda") attention runs as the fused kernels do (`_fused_sdpa`), where torch's CPU
kernels would fall back to the math kernel and its seq x seq probabilities for some shapes. device
"cpu" keeps torch's CPU kernels, for comparisons with steps measured on this machine. Everything
else runs as on CPU (e.g. a LayerNorm's statistics in the input dtype, not fp32).

Compile. The probe keeps torch.compile on with its own backend (`partitioned_backend`): dynamo and
AOT autograd trace each compiled block (and the loss) with inductor's decompositions, and inductor's
min-cut partitioner decides what the forward graph saves for backward (activation checkpointing's
policies and float8 included, as dynamo hands them to it). No code is generated: each graph runs
node by node on fake tensors, and a node's output is counted only where inductor would make it a
buffer (`_fused_runner`). The byte-counting dispatch modes step aside while dynamo traces
(`ignore_compile_internals`) and count when the graphs run.

Mixture of experts. Routing decides tensor sizes from values (how many tokens each expert gets); a
fake tensor has none, so `AssumedValues` gives the probe balanced routing.
"""

from __future__ import annotations

import contextlib
import weakref
from unittest.mock import patch

import torch
import torch.distributed as dist
from torch._dynamo import register_backend
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

DEVICE = torch.device("cpu")
aten = torch.ops.aten


@contextlib.contextmanager
def fake_world(world_size: int):
    """A fake process group of world_size ranks, this process rank 0; destroyed on exit."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists; the estimator needs its own fake one")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches sharding decisions by mesh value: a later world's equal mesh would get this
        # one's process groups (gone with it).
        _clear_sharding_prop_cache()
        _redistribute._gen_transform_infos.cache_clear()


def round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


class _Mode(TorchDispatchMode):
    # Compiled graphs run as traced, higher-order operators included (run_and_save_rng_state, where
    # checkpointed recompute replays a random op); the modes step aside while dynamo traces.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class LiveBytes(_Mode):
    """Bytes of the tensor storages created under this mode and still alive (`now`), each rounded up
    to `granularity`, and the most since the last `reset` (`peak`)."""

    def __init__(self, granularity: int):
        super().__init__()
        self.granularity, self.now, self.peak, self.high = granularity, 0, 0, 0
        self._held = WeakIdKeyDictionary()  # storage -> [its bytes]

    def _free(self, held: list) -> None:
        self.now -= held[0]

    def _add(self, n: int, peak: bool = True) -> None:
        self.now += n
        if peak:
            self.peak, self.high = max(self.peak, self.now), max(self.high, self.now)

    def reset(self) -> tuple[int, int]:
        """(now, peak since the last reset), and start a new peak."""
        out, self.peak = (self.now, self.peak), self.now
        return out

    def __enter__(self):
        # FSDP allocates and frees its gathered parameters by resizing storages, which no dispatch mode sees.
        self._fake = active_fake_mode()
        self._resize = resize = torch.UntypedStorage.resize_

        def tracked_resize(st, size):
            resize(st, size)
            held = self._held.get(st)
            if held is not None:
                n = round_up(st.nbytes(), self.granularity)
                self._add(n - held[0])
                held[0] = n

        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        if any(t is DTensor for t in types_):
            return NotImplemented  # let DTensor run first: its local ops come back here
        if func is torch.ops._c10d_functional.wait_tensor.default:
            out = args[0]  # in eager a wait returns its input, where the fake kernel makes a new tensor
        else:
            out = func(*args, **(kwargs or {}))
        # DTensor's sharding propagation runs ops in a fake mode of its own: they allocate nothing.
        if active_fake_mode() is self._fake and not _fused:
            # An output sharing an input's storage (a view, an in-place op) allocated nothing.
            given = {st._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                     for st in get_untyped_storages(t)}
            # Autograd sums two gradients of one tensor out of place for a fake tensor (a subclass), in
            # place into the first for a real one it alone holds, as on the GPU: that sum raises no peak
            # unless the first outlives it (then the next allocation counts both).
            summed = (func is aten.add.Tensor and not torch.is_grad_enabled()
                      and torch._C._current_graph_task_id() != -1 and len(args) == 2 and not kwargs)
            for st in (s for t in tree_leaves(out) if isinstance(t, torch.Tensor) for s in get_untyped_storages(t)):
                if st not in self._held and st._cdata not in given:
                    self._held[st] = held = [round_up(st.nbytes(), self.granularity)]
                    self._add(held[0], peak=not summed)
                    weakref.finalize(st, self._free, held)
        return out


_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_HISTOGRAMS = (aten.bincount.default, aten.histc.default)
_SHADOW_LIMIT = 1 << 24
_READS = (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default)


class AssumedValues(_Mode):
    """Values where fake tensors have none but the step reads one: real values for the integer tensors
    token routing makes, so that sizes read from them (split sizes, row counts) are those of balanced
    routing (every expert gets tokens x top_k / experts rows); and 1 for any other scalar the host reads
    (true: a finite step, a set float8 scale)."""

    def __init__(self):
        super().__init__()
        self.values = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is DTensor for t in types_):
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if func in _READS:
            with unset_fake_temporarily():
                value = self.values[args[0]].item() if args[0] in self.values else 1
            return bool(value) if func is aten.is_nonzero.default or args[0].dtype == torch.bool else value

        if func is aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            # Its fake kernel knows only the CUDA kernel's bf16; the sizes are those of any dtype.
            out = func(*(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args), **kwargs)
            return torch.empty_strided(out.shape, out.stride(), dtype=args[0].dtype, device=DEVICE)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        known = bool(tensors) and all(t in self.values for t in tensors)
        if func in _HISTOGRAMS and not known:
            out = func(*args, **kwargs)
            with unset_fake_temporarily():  # balanced: the values spread evenly over the bins
                self.values[out] = torch.bincount(torch.arange(args[0].numel()) % out.numel(),
                                                  minlength=out.numel()).to(out.dtype)
            return out
        if known or not tensors:
            real_args, real_kwargs = tree_map_only(torch.Tensor, lambda t: self.values[t], (args, kwargs))
            try:
                out = func(*args, **kwargs)
            except Exception:  # a size only the values give (repeat_interleave by counts): make it from them
                out = None
            if out is None or any(isinstance(t, torch.Tensor) and t.dtype in _INTEGRAL
                                  and t.numel() <= _SHADOW_LIMIT for t in tree_leaves(out)):
                if "empty" in func.__name__:
                    return out  # no values to know
                with unset_fake_temporarily():
                    real = func(*real_args, **real_kwargs)
                if out is None:
                    out = tree_map(lambda r: torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=DEVICE)
                                   if isinstance(r, torch.Tensor) else r, real)
                for f, r in zip(tree_leaves(out), tree_leaves(real)):
                    if isinstance(f, torch.Tensor) and f.dtype in _INTEGRAL:
                        self.values[f] = r
            return out
        out = func(*args, **kwargs)
        if func is aten.topk.default:
            # Balanced routing: row r picks candidates r*k .. r*k + k - 1, round-robin.
            idx = out[1]
            n = args[0].shape[args[2] if len(args) > 2 else kwargs.get("dim", -1)]
            with unset_fake_temporarily():
                self.values[idx] = (torch.arange(idx.numel()) % n).view(idx.shape).to(idx.dtype)
        elif func.namespace in ("c10d", "_c10d_functional"):
            source = next((self.values[t] for t in tensors if t in self.values), None)
            if source is not None:
                for t in [*tensors, *tree_leaves(out)]:
                    if isinstance(t, torch.Tensor) and t.dtype in _INTEGRAL and t not in self.values:
                        with unset_fake_temporarily():
                            flat = source.reshape(-1).repeat(-(-t.numel() // max(source.numel(), 1)))
                            self.values[t] = flat[: t.numel()].view(t.shape).to(t.dtype)
        elif func._schema.is_mutable:
            for t in tensors:  # written from values it does not know
                self.values.pop(t, None)
        return out


class _FusedAttention(torch.autograd.Function):
    """What CUDA's fused SDPA kernels keep for backward: q, k, v, the output, the fp32 log-sum-exp of
    each query row, and a given mask or bias; nothing seq x seq."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([mask] if isinstance(mask, torch.Tensor) else []))
        ctx.mask_grad = isinstance(mask, torch.Tensor) and mask.requires_grad
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _, *mask = ctx.saved_tensors
        return (*map(torch.empty_like, (q, k, v)), torch.empty_like(mask[0]) if ctx.mask_grad else None)


def _fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """CUDA's flash attention op where it applies (no mask, one head width; its fake kernel runs on fake
    CPU tensors), so that autograd, op-level checkpointing and the compiler's partitioner see what a GPU
    runs; else a stand-in keeping what the fused kernels keep (a compiled graph's partitioner sees no
    use of those in its backward: masked attention under compile is counted low)."""
    if attn_mask is None and q.shape[-1] == v.shape[-1] and q.dtype in (torch.float16, torch.bfloat16):
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    return _FusedAttention.apply(q, k, v, attn_mask)


@contextlib.contextmanager
def collective_buffers(live: LiveBytes, pools: dict[str, list[int]]):
    """The two largest allocations of FSDP's all-gather and reduce-scatter calls (on a GPU they allocate
    from their own streams' pools, which the caching allocator keeps for them)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    def watched(name, fn):
        def call(*args, **kwargs):
            start = live.high = live.now
            try:
                return fn(*args, **kwargs)
            finally:
                pools[name] = sorted([*pools.get(name, []), live.high - start])[-2:]
        return call

    with patch.object(group, "foreach_all_gather", watched("foreach_all_gather", group.foreach_all_gather)), \
            patch.object(group, "foreach_reduce", watched("foreach_reduce", group.foreach_reduce)):
        yield


# Set while a compiled graph runs a node inductor would fuse into its consumers: its output is no buffer.
_fused: list = []
_REDUCTIONS = {aten.sum, aten.amax, aten.amin, aten.mean, aten.var_mean, aten.prod, aten.max, aten.min,
               aten.argmax, aten.argmin, aten.any, aten.all}
_INLINED = {aten._to_copy.default, aten.clone.default, aten.where.self, aten.gather.default, aten.index.Tensor,
            torch.ops.prims.convert_element_type.default}


def _inlined(n) -> bool:
    t = n.target
    if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    # A constant, and a scatter into one (cross-entropy's one-hot): inductor makes that a pointwise compare.
    return t in _INLINED or torch.Tag.pointwise in t.tags or t is aten.full.default or (
        t is aten.scatter.value and isinstance(n.args[0], torch.fx.Node) and n.args[0].target is aten.full.default)


def _read_inline(n) -> bool:
    """Whether every read of n's value (through views) is by a node that inlines it."""
    ops = [(u, u.target) for u in n.users if isinstance(u.target, torch._ops.OpOverload)]
    return len(ops) == len(n.users) and all(
        _read_inline(u) if t.is_view else _inlined(u) or t.overloadpacket in _REDUCTIONS for u, t in ops)


def _fused_runner(gm, example_inputs):
    """Run a partitioned forward or backward graph node by node as inductor would allocate it: a pointwise
    node read only by pointwise nodes and reductions is fused into them (no buffer); every other node's
    output is one (matmuls and other library kernels, reductions, what the graph returns or saves)."""
    fused = {n for n in gm.graph.nodes if _inlined(n) and n.users and _read_inline(n)}

    class Run(torch.fx.Interpreter):
        def run_node(self, n):
            _fused[:] = [n] if n in fused else []
            try:
                return super().run_node(n)
            finally:
                _fused.clear()

    run = lambda args: Run(gm).boxed_run(args)  # noqa: E731 (boxed: the interpreter frees inputs as it goes)
    run._boxed_call = True
    return run


@register_backend(name="estimate_partitioned")
def partitioned_backend(gm, example_inputs):
    """A torch.compile backend for the probe: AOT autograd with inductor's decompositions and its min-cut
    partitioner (what a compiled block saves for backward), each graph run by `_fused_runner`."""
    import functools

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    return aot_autograd(fw_compiler=_fused_runner, bw_compiler=_fused_runner, decompositions=select_decomp_table(),
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))(
        gm, example_inputs)


@contextlib.contextmanager
def fake_kernels(cuda: bool):
    """DTensor's sharding propagation in a fake mode of its own, as in eager, so that the global-shape
    tensors it makes are not counted (loss parallel at 8B, seq 8192, TP 8: a whole-vocabulary fp32
    tensor, +8 GiB); cuda: attention as the fused kernels run it (`_fused_sdpa`)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import _sharding_prop

    mode = fake_mode()
    with patch.object(_sharding_prop, "detect_fake_mode", lambda *a, **k: mode), \
            patch.object(F, "scaled_dot_product_attention", _fused_sdpa if cuda else F.scaled_dot_product_attention):
        yield
