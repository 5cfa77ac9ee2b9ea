"""Muon for the blocks' matrices, AdamW for the rest, and optimizer states in bfloat16.

Muon (torch.optim.Muon; Keller Jordan's post, Moonlight's "Muon is Scalable for LLM Training")
keeps one momentum buffer per matrix and steps along its orthogonalised direction, computed by a few
Newton-Schulz iterations on the whole matrix. The arithmetic is torch's own (`torch.optim._muon`),
so one process steps exactly as torch.optim.Muon beside torch.optim.AdamW.

Under FSDP2, HSDP, TP or EP a parameter is a DTensor shard, while Newton-Schulz needs the whole
matrix. `orthogonalized` assembles each matrix once per step and spreads the work: every matrix is
gathered, in one gather, to one owner rank among the ranks that hold its pieces (those along the
mesh dimensions that split it: FSDP's, or TP's, or both at once under FSDP x TP, over their
flattened group), the owner orthogonalises it and scatters the pieces back. Owners are given whole
matrices, largest first, to the least-loaded rank, as in Moonlight's distributed Muon, so under
FSDP x TP the work spreads over all fsdp x tp ranks. Newton-Schulz starts by rounding its input to
bfloat16, so the matrices travel as bfloat16 and the result is the one-process result bit for bit.
Per step and matrix of N elements split over W ranks, the gather and the scatter move
2 x 2 bytes x N x (W - 1) / W in all (each rank sends and receives 1/W of that on average: a quarter
of its share of FSDP's own float32 gradient reduce-scatter); an owner holds its matrices whole, in
bfloat16, twice (gathered and orthogonalised), plus the gathered pieces: about 4-6 bytes x N_muon / W
more per rank during the step (the estimator measures it: estimation/probe.py steps this optimizer).
Experts (a 3-D tensor, one matrix per expert) are orthogonalised one expert at a time; when expert
parallelism splits the expert dimension each rank already holds whole matrices and moves nothing.

Low-precision states (optimizer.state_dtype bfloat16) are kept in bfloat16 and stepped in float32,
then rounded back stochastically: round-to-nearest would drop every increment smaller than half a
bfloat16 ulp (with beta2 = 0.999 the second moment changes by 0.1% a step, under bfloat16's 0.4%
resolution, and would stall), while stochastic rounding is unbiased at no memory cost; a
compensation buffer would bring back the bytes bfloat16 saves. The rounding's random bits are a hash of
(seed, update, parameter, the element's index in the whole parameter; its low 16 bits round the first
moment, its high 16 the second): no generator state, the same
bits for an element whatever the layout (FSDP2 steps as one process), and nothing to read from memory,
so that the AdamW update over bfloat16 moments compiles into one kernel a parameter (on CUDA, where
torch's fused kernels would run: 20 bytes of traffic a parameter against fused float32 AdamW's 28).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz
from torch.optim.adam import adam

from titanlike.models.common.dtensor import local_part

BLOCK_DIMS = (2, 3)  # a matrix, or a stack of experts' matrices


def newton_schulz(update: torch.Tensor, *, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a matrix (bfloat16 out), or of each matrix of a stack."""
    if update.ndim == 2:
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    return torch.stack([_zeropower_via_newtonschulz(m, coefficients, steps, eps) for m in update])


def _sharded_dims(param: torch.Tensor) -> tuple[int, ...] | None:
    """The mesh dimensions a parameter's matrices are split along (gather them to an owner), or None
    where this rank holds them whole (a plain tensor, a replica, experts split by expert)."""
    if not isinstance(param, DTensor):
        return None
    shards = [(i, p) for i, p in enumerate(param.placements) if not isinstance(p, Replicate)]
    if not shards or (param.ndim == 3 and all(type(p) is Shard and p.dim == 0 for _, p in shards)):
        return None
    return tuple(i for i, _ in shards)


def _owners(sizes: list[int], ranks: int) -> list[int]:
    """Whole matrices to ranks, largest first to the least loaded (the same answer on every rank)."""
    load, owner = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owner[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owner[i]] += sizes[i]
    return owner


def _group(mesh, dims: tuple[int, ...]):
    """The process group of the ranks that differ along `dims` of the mesh (this rank's slice)."""
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("distributed Muon needs named mesh dimensions to gather a matrix split along two of them")
    sub = mesh[tuple(names[d] for d in dims)] if len(dims) < mesh.ndim else mesh
    # Created at the first step by every rank (DeviceMesh keeps its flattened views), from the mesh's
    # own rank layout: real data even where the step runs on fake tensors (estimation/probe.py).
    with unset_fake_temporarily():
        return sub._flatten().get_group()


def _pieces(param: torch.Tensor, dims: tuple[int, ...], ranks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(local shape, global offset) of every rank of the group along the mesh `dims`, in group rank
    order (row-major over those dims, as get_group and _flatten lay them out): each holds one block
    of the parameter (FSDP's and TP's shards, strided ones included, are blocks, as DCP saves them)."""
    mesh = param.device_mesh
    sizes = [mesh.shape[d] for d in dims]
    out = []
    for r in range(ranks):
        coordinate = list(mesh.get_coordinate())
        for d, size in zip(reversed(dims), reversed(sizes)):
            coordinate[d], r = r % size, r // size
        out.append(_compute_local_shape_and_global_offset(param.shape, mesh.shape, coordinate, param.placements))
    return out


def _padded(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """t at the start of a zero tensor of `shape` (t's own when it fits)."""
    if list(t.shape) == list(shape):
        return t.contiguous()
    out = t.new_zeros(shape)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


def _block(t: torch.Tensor, shape, offset) -> torch.Tensor:
    """The view of t at `offset` of `shape` (one rank's piece of a parameter-shaped tensor)."""
    return t[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def orthogonalized(updates: list[torch.Tensor], params: list[torch.Tensor],
                   ns: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """ns(full update) of each parameter, as this rank's piece (the local shape of its update).

    updates: the local pieces (plain tensors) of each parameter's update; params: the parameters,
    whose placements say how the pieces make the whole."""
    out: list[torch.Tensor | None] = [None] * len(params)
    spread: dict[tuple, list[int]] = {}
    for i, (u, p) in enumerate(zip(updates, params)):
        dims = _sharded_dims(p)
        if dims is None:
            out[i] = ns(u)
        else:
            spread.setdefault((id(p.device_mesh), dims), []).append(i)
    for (_, dims), items in spread.items():
        group = _group(params[items[0]].device_mesh, dims)
        _gather_orthogonalize_scatter(items, updates, params, ns, group, dims, out)
    return out


def _gather_orthogonalize_scatter(items, updates, params, ns, group, dims, out) -> None:
    """Each matrix gathered whole to its owner, orthogonalised there, its pieces scattered back."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    owners = _owners([params[i].numel() for i in items], ranks)
    blocks = {i: _pieces(params[i], dims, ranks) for i in items}
    # Every piece travels padded to the largest piece's shape (uneven shards).
    largest = {i: [max(shape[d] for shape, _ in blocks[i]) for d in range(params[i].ndim)] for i in items}
    # bfloat16 travels as float16 bits (gloo moves no bfloat16 and no int16; gather and scatter only copy).
    pending, gathered = [], {}
    for i, owner in zip(items, owners):
        piece = _padded(updates[i].bfloat16(), largest[i]).view(torch.float16)
        bufs = [torch.empty_like(piece) for _ in range(ranks)] if owner == me else None
        pending.append(dist.gather(piece, bufs, group=group, group_dst=owner, async_op=True))
        gathered[i] = bufs
    for work in pending:
        work.wait()
    pending, received = [], {}
    for i, owner in zip(items, owners):
        pieces = None
        if owner == me:
            whole = updates[i].new_empty(params[i].shape, dtype=torch.bfloat16)
            for buf, (shape, offset) in zip(gathered.pop(i), blocks[i]):
                _block(whole, shape, offset).copy_(_block(buf.view(torch.bfloat16), shape, [0] * len(shape)))
            result = ns(whole).bfloat16()
            pieces = [_padded(_block(result, shape, offset), largest[i]).view(torch.float16)
                      for shape, offset in blocks[i]]
        received[i] = updates[i].new_empty(largest[i], dtype=torch.float16)
        pending.append(dist.scatter(received[i], pieces, group=group, group_src=owner, async_op=True))
    for work in pending:
        work.wait()
    for i in items:
        out[i] = _block(received[i].view(torch.bfloat16), updates[i].shape, [0] * updates[i].ndim)


_MASK32 = 0xFFFFFFFF
_EAGER_CHUNK = 1 << 22  # elements updated at once outside torch.compile


def _mix32(x):
    """murmur3's 32-bit finalizer (a bijection that spreads every input bit over the output), on Python
    ints or int64 tensors holding 32-bit values; products are masked back to 32 bits."""
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _MASK32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _signed32(c: int) -> int:
    return c - (1 << 32) if c >= 1 << 31 else c


def _mix32_int32(x: torch.Tensor) -> torch.Tensor:
    """_mix32 on an int32 tensor holding the 32 bits (the same function mod 2**32): int32's products wrap,
    its right shifts are masked to be logical."""
    x = (x ^ ((x >> 16) & 0xFFFF)) * _signed32(0x85EBCA6B)
    x = (x ^ ((x >> 13) & 0x7FFFF)) * _signed32(0xC2B2AE35)
    return x ^ ((x >> 16) & 0xFFFF)


def rounding_key(seed: int, update: int, position: int) -> int:
    """The rounding bits' key of one parameter at one update: distinct per (seed, update, position)."""
    return _mix32((_mix32((seed * 1_000_003 + update) & _MASK32) + position) & _MASK32)


def rounding_bits(shape, key: int, offset=None, whole_shape=None, device=None) -> torch.Tensor:
    """32 pseudo-random bits for each element of a block `shape` at `offset` of a tensor of `whole_shape`
    (a shard's local block; the whole tensor by default): a hash of the key and the element's row-major
    index in the whole tensor. Counter-based: no generator state, nothing read from memory under
    torch.compile, and the same bits for an element whatever the layout splitting it. Eager, computed in
    int32, whose sums and products wrap (a few times faster than int64); under torch.compile in int64
    masked to 32 bits (inductor's CPU code for the int32 form does not build): the same bits."""
    offset, whole_shape = offset or [0] * len(shape), whole_shape or list(shape)
    wide = torch.compiler.is_compiling()
    dtype = torch.int64 if wide else torch.int32
    # int64 takes the numbers as they are (its products wrap too, keeping the low 32 bits); masking a
    # symbolic size under dynamic shapes makes inductor type the index as a float.
    word = (lambda c: c) if wide else (lambda c: _signed32(c & _MASK32))
    index = torch.zeros((), dtype=dtype, device=device)
    stride = 1
    for d in reversed(range(len(shape))):  # the index mod 2**32 (a 128k x 16k embedding has 2**31 elements)
        along = torch.arange(shape[d], dtype=dtype, device=device) + word(offset[d])
        index = index + (along * word(stride)).view([-1] + [1] * (len(shape) - 1 - d))
        stride *= whole_shape[d]
    if wide:
        return _mix32((index * 0x9E3779B1 + word(key)) & _MASK32)
    return _mix32_int32(index * word(0x9E3779B1) + word(key))


def stochastic_round(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16, rounding up or down with probability given by the distance (unbiased): 16 random
    bits (0-65535, one per element) added below bfloat16's last bit, then truncated. A finite float's bits
    plus 65535 stay within int32 (the largest is 0x7F7FFFFF), and the sign bit is kept: magnitudes round."""
    summed = (x.contiguous().view(torch.int32) + bits.to(torch.int32)) & -65536
    return summed.view(torch.float32).to(torch.bfloat16)


def _store(state: torch.Tensor, value: torch.Tensor, skip, bits: torch.Tensor | None) -> None:
    """value into a state tensor (rounded stochastically into a bfloat16 one); the old state where skip."""
    if skip is not None:
        value = torch.where(skip, state.float(), value)
    state.copy_(stochastic_round(value, bits) if state.dtype == torch.bfloat16 else value)


def _eager_rows(t: torch.Tensor) -> int | None:
    """Rows of t updated at once eagerly (the update's float32 and the hash's int32 temporaries, a few dozen
    bytes an element, stay small beside a 128k-vocabulary embedding); None when t is updated whole
    (compiled, they live in registers)."""
    if torch.compiler.is_compiling() or t.ndim == 0:
        return None
    rows = max(1, _EAGER_CHUNK // max(1, t[0].numel()))
    return rows if t.shape[0] > rows else None


def adamw_low_precision_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, step: torch.Tensor, scale, skip, *, lr: float,
                               beta1: float, beta2: float, eps: float, weight_decay: float, key: int,
                               offset, whole_shape) -> None:
    """One AdamW step of one parameter (plain tensors: a shard's local block) in float32 arithmetic over
    low-precision moments, rounded back stochastically (one hash an element: its low 16 bits round the
    first moment, its high 16 the second). Tensors and numbers only, no generator: under torch.compile it
    is one kernel that reads the parameter, its gradient and two bfloat16 moments and writes three (20
    bytes a parameter, against fused float32 AdamW's 28)."""
    step.add_(1 if skip is None else (~skip).float())
    rows = _eager_rows(param)
    for i in range(0, param.shape[0], rows) if rows else [None]:
        part = slice(None) if i is None else slice(i, i + rows)
        at = offset if i is None else [offset[0] + i, *offset[1:]]
        p, g, m, v = param[part], grad[part], exp_avg[part], exp_avg_sq[part]
        if scale is not None:
            g = g / scale
        m32 = m.float().lerp(g, 1 - beta1)
        v32 = v.float().mul(beta2).addcmul(g, g, value=1 - beta2)
        bits = rounding_bits(p.shape, key, at, whole_shape, p.device) if m.dtype == torch.bfloat16 else None
        _store(m, m32, skip, None if bits is None else bits & 0xFFFF)
        _store(v, v32, skip, None if bits is None else (bits >> 16) & 0xFFFF)
        # Adam is built without weight decay (train/optimizer.py), so the decay is AdamW's.
        denom = (v32.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
        new = p.mul(1 - lr * weight_decay).sub_((lr / (1 - beta1 ** step)) * m32 / denom)
        p.copy_(new if skip is None else torch.where(skip, p, new))


def _block_of(param: torch.Tensor) -> tuple[list[int], list[int]]:
    """(offset, whole shape) of this rank's block of a parameter (a DTensor's local shard, or all of it)."""
    if not isinstance(param, DTensor):
        return [0] * param.ndim, list(param.shape)
    mesh = param.device_mesh
    _, offset = _compute_local_shape_and_global_offset(param.shape, mesh.shape, list(mesh.get_coordinate()),
                                                       param.placements)
    return list(offset), list(param.shape)


class MuonAdamW(torch.optim.Adam):
    """Muon over the groups marked "muon", Adam(W) over the others (torch's kernels when states are
    float32), with states in `state_dtype`.

    It is one torch Optimizer (the schedule, checkpoints and the step see one object), an Adam whose
    Muon groups carry their own options. Under fused kernels the training step hands it the
    gradients' scale and the step's non-finite verdict on the device (train/step.py); the Muon and
    low-precision steps honour both without reading them on the host.
    """

    def __init__(self, groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, decoupled: bool, implementation: str, state_dtype: torch.dtype,
                 seed: int = 0, compile_update: bool | None = None):
        self.state_dtype, self.seed = state_dtype, seed
        # Set by the training step under fused kernels (train/step.py), as for torch's fused Adam.
        self.grad_scale: torch.Tensor | None = None
        self.found_inf: torch.Tensor | None = None
        fused = implementation == "fused"
        self._blocks: dict[torch.Tensor, tuple[list[int], list[int]]] = {}
        # torch has no fused AdamW over bfloat16 moments of float32 parameters: where its fused kernels
        # would run (CUDA), the low-precision update is compiled into one kernel a parameter; elsewhere it
        # runs eagerly (no compile time on a CPU). compile_update forces either (the tests compile on CPU).
        on_cuda = any(local_part(p).device.type == "cuda" for g in groups for p in g["params"])
        if compile_update is None:
            compile_update = fused and on_cuda and state_dtype != torch.float32
        self._low_precision_update = (torch.compile(adamw_low_precision_update, dynamic=True, fullgraph=True)
                                      if compile_update else adamw_low_precision_update)
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         foreach=implementation == "foreach" and state_dtype == torch.float32,
                         fused=fused, decoupled_weight_decay=decoupled)
        for group in self.param_groups:
            group.setdefault("muon", False)

    def __setstate__(self, state: dict) -> None:
        # Adam's would convert every parameter's "step", which Muon's state has none of; the groups
        # carry all their options already (this class saves them). Optimizer.load_state_dict casts
        # the states to the parameters' dtype: bfloat16 ones are cast back.
        torch.optim.Optimizer.__setstate__(self, state)
        for per_param in self.state.values():
            for key, value in per_param.items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    per_param[key] = value.to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, skip = self.grad_scale, self.found_inf.bool() if self.found_inf is not None else None
        for group in self.param_groups:
            if group["muon"]:
                self._muon(group, scale, skip)
            elif self.state_dtype == torch.float32:
                self._adam(group, scale)
            else:
                self._adam_low_precision(group, scale, skip)
        return loss

    def _rounding_update(self, group: dict) -> int | None:
        """This update's count for the stochastic rounding's keys (saved with the group's
        hyper-parameters, so that a resumed run rounds as the uninterrupted one); None for float32 states."""
        if self.state_dtype == torch.float32:
            return None
        group["rounding"] = group.get("rounding", 0) + 1
        return group["rounding"]

    def _block(self, param: torch.Tensor) -> tuple[list[int], list[int]]:
        if param not in self._blocks:  # the layout does not change within a run
            self._blocks[param] = _block_of(param)
        return self._blocks[param]

    def _muon(self, group: dict, scale, skip) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
        update = self._rounding_update(group)
        updates = []
        for position, p in enumerate(params):
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=self.state_dtype)
            grad = local_part(p.grad) if scale is None else local_part(p.grad) / scale
            buf = local_part(state["momentum_buffer"])
            if buf.dtype == torch.float32 and skip is None:  # torch.optim.Muon's own steps
                buf.lerp_(grad, 1 - momentum)
                new = buf
            else:
                new = buf.float().lerp(grad, 1 - momentum)
                bits = None if update is None else \
                    rounding_bits(buf.shape, rounding_key(self.seed, update, position), *self._block(p), buf.device)
                _store(buf, new, skip, None if bits is None else bits & 0xFFFF)
            updates.append(grad.lerp(new, momentum) if group["nesterov"] else new)
        ns = lambda u: newton_schulz(u, coefficients=tuple(group["ns_coefficients"]), steps=group["ns_steps"],
                                     eps=group["muon_eps"])
        for p, o in zip(params, orthogonalized(updates, params, ns)):
            adjusted = _adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:])
            local = local_part(p)
            if skip is None:
                local.mul_(1 - lr * wd)
                local.add_(o, alpha=-adjusted)
            else:
                local.copy_(torch.where(skip, local, local.mul(1 - lr * wd).add_(o, alpha=-adjusted)))

    def _adam(self, group: dict, scale) -> None:
        """torch.optim.Adam.step's body for one group."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"],
             has_complex=has_complex, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
             differentiable=group["differentiable"], fused=group["fused"], grad_scale=scale,
             found_inf=self.found_inf, decoupled_weight_decay=group["decoupled_weight_decay"])

    def _adam_low_precision(self, group: dict, scale, skip) -> None:
        """Adam(W) in float32 arithmetic over bfloat16 moments (rounded stochastically)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        beta1, beta2 = group["betas"]
        update = self._rounding_update(group)
        for position, p in enumerate(params):
            state = self.state[p]
            if not state:
                # On the parameter's device, so that a skipped step leaves it without a host sync.
                state["step"] = torch.zeros((), dtype=torch.float32, device=local_part(p).device)
                state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
            offset, whole_shape = self._block(p)
            self._low_precision_update(
                local_part(p), local_part(p.grad), local_part(state["exp_avg"]), local_part(state["exp_avg_sq"]),
                state["step"], scale, skip, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"], key=rounding_key(self.seed, update, position),
                offset=offset, whole_shape=whole_shape)
