"""The Mamba-2 mixer (Dao & Gu 2024), in plain PyTorch, for any family that mixes it in.

    u -> in_proj -> z (gate), x B C (conv inputs), dt (step sizes)
      -> causal depthwise conv over x B C, SiLU
      -> the selective state-space scan (models/common/ssd.py; mamba_ssm's kernels on CUDA)
      -> + D x (skip), gated RMSNorm: norm(y * silu(z)) per group of heads
      -> out_proj

Heads and groups. H heads of P features; the heads split into G groups that share the input
and output maps B and C (N features each), as grouped-query attention's heads share k and v.

Layout: group by group. in_proj's output features are ordered group by group, each group
holding [z of its heads, x of its heads, B, C, dt of its heads], and the conv channels likewise
[x of its heads, B, C]; per-head vectors (A_log, D, dt_bias) and the gated norm follow head order.
So a tensor-parallel split of the output features by rank (a plain column split, Shard(0)) hands
each rank whole groups with everything they need, as attention's heads are split: in_proj
colwise, out_proj rowwise, the conv filters, per-head vectors and norm weight split on dim 0
(`mamba2_sharding`, at the end of this file), and the gated norm, which normalizes per group,
needs no communication. The tensor-parallel degree must divide the groups. Hugging Face and Megatron keep in_proj as
[z, x, B, C, dt] over all heads; `grouped_rows` gives the permutation (hybrid/hf_adapter.py).

Context parallelism. The conv and the scan carry information along the sequence, so a rank
holding pieces of it needs the end of the piece before each of its own: `sequence_carry`, set
by parallel/context.py, hands the last conv inputs of each piece to the next and carries the
scan's state across pieces (a linear recurrence over pieces). Exact, not an approximation.

Kernels. On CUDA with the `mamba_ssm` package installed (an optional extra) the scan runs in
its Triton kernel (`mamba_chunk_scan_combined`); elsewhere, and with `kernel = "torch"`, in the
PyTorch chunked scan. The choice is made when the weights are initialized on their device (the
model is built on the meta device) and logged once per process.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models import protocol
from titanlike.models.common.dtensor import local_part
from titanlike.models.common.init import LinearInit, ones_, uniform_
from titanlike.models.common.kv_cache import lazy_buffer
from titanlike.models.common.sharding import Style, colwise, gather_layouts, rowwise
from titanlike.models.common.ssd import carried_output, ssd_scan
from titanlike.models.spec_types import ShardOptions

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel.style import ParallelStyle

logger = logging.getLogger(__name__)

SCAN_KERNELS = ("auto", "torch")


@dataclass
class Mamba2Args:
    """A Mamba-2 mixer's sizes and settings (a family's args hold one)."""

    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128  # N
    n_groups: int = 8  # G: groups of heads sharing B and C
    conv_kernel: int = 4
    chunk_size: int = 128  # tokens per chunk of the chunked scan
    conv_bias: bool = True
    # dt = softplus(raw dt + dt_bias), clamped to [dt_limit_min, dt_limit_max] (None: no upper limit).
    dt_limit_min: float = 0.0
    dt_limit_max: float | None = None
    # Initialization, as mamba_ssm: dt log-uniform in [dt_min, dt_max] (at least dt_init_floor),
    # stored as its inverse softplus in dt_bias; A = -uniform(a_init_min, a_init_max), stored as A_log.
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    a_init_min: float = 1.0
    a_init_max: float = 16.0
    kernel: str = "auto"  # auto: mamba_ssm's kernel on CUDA when installed, else PyTorch | torch

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mamba {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba num_heads ({self.num_heads}) must be divisible by n_groups ({self.n_groups})")
        if self.kernel not in SCAN_KERNELS:
            raise ValueError(f"mamba kernel {self.kernel!r} is not one of {SCAN_KERNELS}")
        if not 0 < self.dt_min <= self.dt_max or not 0 < self.a_init_min <= self.a_init_max:
            raise ValueError("mamba dt_min <= dt_max and a_init_min <= a_init_max must be positive")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.n_groups

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x of every head, B and C of every group."""
        return self.inner_dim + 2 * self.n_groups * self.state_size

    @property
    def in_proj_dim(self) -> int:
        return self.inner_dim + self.conv_dim + self.num_heads

    def params(self, dim: int) -> int:
        """Parameters of one mixer: in_proj, conv (+ bias), dt_bias, A_log, D, norm, out_proj."""
        conv = self.conv_dim * (self.conv_kernel + (1 if self.conv_bias else 0))
        return dim * self.in_proj_dim + conv + 3 * self.num_heads + self.inner_dim + self.inner_dim * dim

    def scan_flops_per_token(self) -> int:
        """Forward FLOPs per token of the chunked scan (what 2 x parameters does not count), with
        the full chunk x chunk score block (as attention's term counts the full T x T scores):
        scores C.B per group 2 Q G N, the decayed sum over values 2 Q H P, each chunk's state and
        its read-out 2 x 2 H P N."""
        q, h, p, n, g = self.chunk_size, self.num_heads, self.head_dim, self.state_size, self.n_groups
        return 2 * q * g * n + 2 * q * h * p + 4 * h * p * n


def grouped_rows(args: Mamba2Args) -> tuple[torch.Tensor, torch.Tensor]:
    """(in_proj rows, conv channels) in our group-by-group order, as indices into the usual order
    ([z, x, B, C, dt] over all heads for in_proj, [x, B, C] for the conv): ours = usual[index]."""
    h, p, g, n, hg = args.num_heads, args.head_dim, args.n_groups, args.state_size, args.heads_per_group
    inner = h * p
    rows, channels = [], []
    for group in range(g):
        heads = torch.arange(group * hg * p, (group + 1) * hg * p)
        b = inner + group * n + torch.arange(n)
        c = inner + g * n + group * n + torch.arange(n)
        channels += [heads, b, c]
        dt = 2 * inner + 2 * g * n + group * hg + torch.arange(hg)
        rows += [heads, inner + heads, inner + b, inner + c, dt]
    return torch.cat(rows), torch.cat(channels)


class GatedRMSNorm(nn.Module):
    """norm(x * silu(z)) * weight, the RMS taken over groups of group_size features (Mamba-2's
    norm_before_gate=False). Under tensor parallelism a rank holds whole groups."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = (x.float() * F.silu(z.float())).unflatten(-1, (-1, self.group_size))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.flatten(-2) * local_part(self.weight).float()


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                context: torch.Tensor | None = None, documents: torch.Tensor | None = None,
                context_documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of x (batch, seq, channels) with weight (channels, K): token t
    reads tokens t-K+1 .. t. context (batch, K-1, channels): the K-1 inputs before token 0 (zeros
    when None). With documents (batch, seq) ids (and context_documents (batch, K-1)), a token reads
    only inputs of its own document."""
    batch, seq, channels = x.shape
    k = weight.shape[1]
    if context is None:
        context = x.new_zeros(batch, k - 1, channels)
    padded = torch.cat([context.to(x.dtype), x], dim=1)
    weight = weight.to(x.dtype)
    if documents is None:
        bias = None if bias is None else bias.to(x.dtype)
        return F.conv1d(padded.transpose(1, 2), weight.unsqueeze(1), bias, groups=channels).transpose(1, 2)
    if context_documents is None:
        context_documents = documents[:, :1].expand(batch, k - 1)
    padded_docs = torch.cat([context_documents, documents], dim=1)
    out = 0 if bias is None else bias.to(x.dtype)
    for j in range(k):  # tap j multiplies the input K-1-j tokens back
        same = (padded_docs[:, j:j + seq] == documents).unsqueeze(-1)
        out = out + padded[:, j:j + seq] * same * weight[:, j]
    return out


@functools.cache
def scan_implementation(kernel: str, device_type: str) -> str:
    """"mamba_ssm" or "torch", logged once per process and choice: mamba_ssm's Triton kernel
    needs CUDA and the package (pip install mamba-ssm); everything else runs the PyTorch scan."""
    if kernel == "auto" and device_type == "cuda":
        try:
            import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
        except ImportError:
            logger.info("Mamba-2 scan: PyTorch chunked scan (mamba_ssm is not installed)")
            return "torch"
        logger.info("Mamba-2 scan: mamba_ssm Triton kernels")
        return "mamba_ssm"
    why = "kernel torch" if kernel == "torch" else f"no mamba_ssm kernels on {device_type}"
    logger.info(f"Mamba-2 scan: PyTorch chunked scan ({why})")
    return "torch"


class Mamba2Mixer(nn.Module):
    """The mixer: (batch, seq, dim) -> (batch, seq, dim). See the module docstring."""

    # The parameters tensor parallelism splits on dim 0 with the heads (models/protocol.py).
    head_split_parameters = ("conv_weight", "conv_bias", "dt_bias", "A_log", "D", "norm.weight")

    def __init__(self, dim: int, args: Mamba2Args, *, norm_eps: float):
        super().__init__()
        self.args = args
        self.in_proj = nn.Linear(dim, args.in_proj_dim, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(args.conv_dim, args.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(args.conv_dim)) if args.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(args.num_heads))
        self.A_log = nn.Parameter(torch.empty(args.num_heads))
        self.D = nn.Parameter(torch.empty(args.num_heads))
        self.norm = GatedRMSNorm(args.inner_dim, args.inner_dim // args.n_groups, norm_eps)
        self.out_proj = nn.Linear(args.inner_dim, dim, bias=False)
        # Context parallelism's hook (parallel/context.py ContextParallelCarry); None: this rank
        # holds whole sequences.
        self.sequence_carry = None
        # "mamba_ssm" or "torch", picked by init_weights once the parameters are on their device
        # (a plain attribute, so compiled code reads a constant); None: picked at the first forward.
        self.scan_impl: str | None = None

    def forward(self, u: torch.Tensor, mask=None, *, cache: MambaState | None = None) -> torch.Tensor:
        """u: (batch, seq, dim); mask: a DocumentMask (the state resets where a document starts);
        cache: this layer's state when generating (MambaState)."""
        if cache is not None:
            return self._generate(u, cache)
        a = self.args
        batch, seq, _ = u.shape
        width = a.heads_per_group * a.head_dim
        n = a.state_size
        # (batch, seq, local groups, per-group features): under TP this rank's groups only.
        zxbcdt = self.in_proj(u)
        zxbcdt = zxbcdt.view(batch, seq, -1, 2 * width + 2 * n + a.heads_per_group)
        z, xbc, dt = zxbcdt.split([width, width + 2 * n, a.heads_per_group], dim=-1)
        groups = z.shape[2]
        documents = self._documents(mask, seq, u.device)
        xbc = F.silu(self._conv(xbc.reshape(batch, seq, -1), mask, documents))
        x, B, C = xbc.view(batch, seq, groups, width + 2 * n).split([width, n, n], dim=-1)
        x = x.reshape(batch, seq, -1, a.head_dim)
        dt = F.softplus(dt.reshape(batch, seq, -1).float() + local_part(self.dt_bias).float())
        dt = dt.clamp(min=a.dt_limit_min, max=a.dt_limit_max)
        A = -torch.exp(local_part(self.A_log).float())
        y = self._scan(x, dt, A, B, C, documents, mask)
        y = y + x.float() * local_part(self.D).float()[:, None]
        y = self.norm(y.reshape(batch, seq, -1), z.reshape(batch, seq, -1))
        return self.out_proj(y.to(zxbcdt.dtype))

    # Generation ----------------------------------------------------------------------------------

    def new_cache(self, cache, dtype: torch.dtype) -> MambaState:
        return MambaState(cache, dtype)

    def _generate(self, u: torch.Tensor, state: MambaState) -> torch.Tensor:
        """The forward of a prefill (right-padded prompts, the state left at each row's last real
        token) or of a decode step (one token per row: the conv and the scan advanced by one step,
        the recurrence of ssd.py)."""
        a = self.args
        batch, seq, _ = u.shape
        width, n = a.heads_per_group * a.head_dim, a.state_size
        zxbcdt = self.in_proj(u)
        zxbcdt = zxbcdt.view(batch, seq, -1, 2 * width + 2 * n + a.heads_per_group)
        z, xbc, dt = zxbcdt.split([width, width + 2 * n, a.heads_per_group], dim=-1)
        groups = z.shape[2]
        xbc = xbc.reshape(batch, seq, -1)
        weight, bias = local_part(self.conv_weight), local_part(self.conv_bias)
        prefilling = state.cache.prefilling
        if prefilling:
            conv = causal_conv(xbc, weight, bias)
            # The conv's context for the next token: the K-1 inputs before each row's length
            # (token t is row t + K-1 of the zero-padded inputs).
            padded = torch.cat([xbc.new_zeros(batch, a.conv_kernel - 1, xbc.shape[-1]), xbc], dim=1)
            index = state.cache.prompt_lengths[:, None] + torch.arange(a.conv_kernel - 1, device=u.device)
            state.conv = state.cache.keep(state.conv, padded.gather(1, index[..., None].expand(-1, -1, xbc.shape[-1]))
                                          .to(state.dtype))
        else:
            window = torch.cat([state.conv.to(xbc.dtype), xbc], dim=1)  # (batch, K, channels)
            conv = (window * weight.to(xbc.dtype).t()).sum(1, keepdim=True)
            if bias is not None:
                conv = conv + bias.to(xbc.dtype)
            state.conv = state.cache.keep(state.conv, window[:, 1:].to(state.conv.dtype))
        xbc = F.silu(conv)
        x, B, C = xbc.view(batch, seq, groups, width + 2 * n).split([width, n, n], dim=-1)
        x = x.reshape(batch, seq, -1, a.head_dim)
        dt = F.softplus(dt.reshape(batch, seq, -1).float() + local_part(self.dt_bias).float())
        dt = dt.clamp(min=a.dt_limit_min, max=a.dt_limit_max)
        A = -torch.exp(local_part(self.A_log).float())
        if prefilling:
            # Placeholders past a row's prompt take steps of 0: they neither decay nor add to the
            # state, so the final state is the one after the row's last real token.
            real = torch.arange(seq, device=u.device)[None, :] < state.cache.prompt_lengths[:, None]
            y, ssm = self._chunked_scan(x, dt * real[..., None], A, B, C, None)
            state.ssm = state.cache.keep(state.ssm, ssm)
        else:
            per_group = x.shape[2] // groups
            step_dt = dt[:, 0]  # (batch, heads)
            b_in = B[:, 0].float().repeat_interleave(per_group, dim=1)  # (batch, heads, n)
            c_out = C[:, 0].float().repeat_interleave(per_group, dim=1)
            update = (step_dt[..., None] * x[:, 0].float())[..., None] * b_in[:, :, None, :]
            state.ssm = state.cache.keep(state.ssm, torch.exp(step_dt * A)[..., None, None] * state.ssm + update)
            y = torch.einsum("bhpn,bhn->bhp", state.ssm, c_out)[:, None]
        y = y + x.float() * local_part(self.D).float()[:, None]
        y = self.norm(y.reshape(batch, seq, -1), z.reshape(batch, seq, -1))
        return self.out_proj(y.to(zxbcdt.dtype))

    # Sequence plumbing ---------------------------------------------------------------------------

    def _documents(self, mask, seq: int, device) -> torch.Tensor | None:
        """Document ids of this module's tokens (batch, seq), or None without a document mask."""
        if mask is None:
            return None
        if self.sequence_carry is None:
            return mask.document_ids
        return mask.document_ids[:, self.sequence_carry.local_positions(seq, device)]

    def _conv(self, xbc: torch.Tensor, mask, documents: torch.Tensor | None) -> torch.Tensor:
        weight, bias = local_part(self.conv_weight), local_part(self.conv_bias)
        carry = self.sequence_carry
        if carry is None:
            return causal_conv(xbc, weight, bias, documents=documents)
        # Pieces of the sequence: each gets the last K-1 inputs of the piece before it.
        k, pieces = weight.shape[1], carry.pieces
        batch, seq, channels = xbc.shape
        length = seq // pieces
        if length < k - 1:
            raise ValueError(f"context parallel pieces of {length} tokens are shorter than the conv's "
                             f"{k - 1} tokens of context")
        split = xbc.view(batch, pieces, length, channels).transpose(0, 1)  # (pieces, batch, length, C)
        context = carry.previous(split[:, :, length - (k - 1):])
        fold = (lambda t: t.reshape(pieces * batch, *t.shape[2:]))
        docs = context_docs = None
        if documents is not None:
            docs = fold(documents.view(batch, pieces, length).transpose(0, 1))
            before = carry.positions_before(seq, k - 1, xbc.device)  # (pieces, K-1), -1 before the start
            context_docs = fold(mask.document_ids[:, before.clamp(min=0)].transpose(0, 1))
        out = causal_conv(fold(split), weight, bias, context=fold(context), documents=docs,
                          context_documents=context_docs)
        return out.view(pieces, batch, length, channels).transpose(0, 1).reshape(batch, seq, channels)

    def _scan(self, x, dt, A, B, C, documents, mask) -> torch.Tensor:
        """y (batch, seq, local heads, P) in fp32, without the D skip."""
        carry = self.sequence_carry
        if carry is None:
            return self._chunked_scan(x, dt, A, B, C, documents)[0]
        # Scan each piece from a zero state, then add what the state entering it contributes: the
        # states are carried across pieces in sequence order (carry.incoming).
        pieces = carry.pieces
        batch, seq = x.shape[:2]
        length = seq // pieces
        fold = (lambda t: t.reshape(batch, pieces, length, *t.shape[2:]).transpose(0, 1)
                .reshape(pieces * batch, length, *t.shape[2:]))
        xs, dts, Bs, Cs = (fold(t) for t in (x, dt, B, C))
        docs = None if documents is None else fold(documents)
        y, final = self._chunked_scan(xs, dts, A, Bs, Cs, docs)
        # How each piece scales the state entering it: exp(sum of dt A), or 0 when a document
        # starts inside it (the entering state's document has ended).
        decay = torch.exp((dts * A).sum(1))  # (pieces * batch, heads)
        reads = None
        if docs is not None:
            before = carry.positions_before(seq, 1, x.device)[:, 0]  # (pieces,) position before each piece
            doc_before = mask.document_ids[:, before.clamp(min=0)].transpose(0, 1).reshape(-1, 1)
            reads = docs == doc_before  # tokens still in the document the entering state belongs to
            decay = decay * reads[:, -1:]
        unfold = (lambda t: t.view(pieces, batch, *t.shape[1:]))
        entering = carry.incoming(unfold(final), unfold(decay)[..., None, None])
        y = y + carried_output(Cs, dts, A, entering.reshape(pieces * batch, *entering.shape[2:]), reads)
        return y.view(pieces, batch, length, *y.shape[2:]).transpose(0, 1).reshape(batch, seq, *y.shape[2:])

    def _chunked_scan(self, x, dt, A, B, C, documents):
        impl = self.scan_impl or scan_implementation(self.args.kernel, x.device.type)
        if impl == "mamba_ssm":
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

            seq_idx = None if documents is None else documents.to(torch.int32).contiguous()
            # Its Triton kernels want the feature dims contiguous (ours are views of in_proj's output).
            y, final = mamba_chunk_scan_combined(x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous(),
                                                 self.args.chunk_size, seq_idx=seq_idx, return_final_states=True)
            return y.float(), final.float()
        return ssd_scan(x, dt, A, B, C, chunk_size=self.args.chunk_size, documents=documents)

    # Initialization --------------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, init: LinearInit, *, seed: int, prefix: str) -> None:
        a = self.args
        self.scan_impl = scan_implementation(a.kernel, local_part(self.A_log).device.type)
        init.fill(self.in_proj.weight, seed=seed, fqn=f"{prefix}in_proj.weight")
        init.fill(self.out_proj.weight, seed=seed, fqn=f"{prefix}out_proj.weight", output=True)
        # The conv as PyTorch initializes a depthwise Conv1d: uniform within 1/sqrt(K).
        bound = a.conv_kernel ** -0.5
        uniform_(self.conv_weight, low=-bound, high=bound, seed=seed, fqn=f"{prefix}conv_weight")
        if self.conv_bias is not None:
            uniform_(self.conv_bias, low=-bound, high=bound, seed=seed, fqn=f"{prefix}conv_bias")
        # Draws are elementwise, so transforming this rank's shard transforms the whole.
        uniform_(self.A_log, low=a.a_init_min, high=a.a_init_max, seed=seed, fqn=f"{prefix}A_log")
        local_part(self.A_log).log_()
        uniform_(self.dt_bias, low=math.log(a.dt_min), high=math.log(a.dt_max), seed=seed, fqn=f"{prefix}dt_bias")
        dt = local_part(self.dt_bias).exp().clamp(min=a.dt_init_floor)
        local_part(self.dt_bias).copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        ones_(self.D)
        ones_(self.norm.weight)


class MambaState:
    """What a Mamba-2 layer keeps while generating: the last K-1 conv inputs (batch, K-1, channels)
    and the SSM state (batch, heads, head_dim, state_size, float32), this rank's heads only. Both
    are replaced as a whole each step (their size does not grow with the sequence; a static cache
    copies them into the tensors it holds, ModelCache.keep), first by the prefill, which gives them
    their shapes (the forward's own: a weight outside the forward may be an FSDP shard)."""

    def __init__(self, cache, dtype: torch.dtype):
        self.cache, self.dtype = cache, dtype
        self.conv: torch.Tensor | None = None
        self.ssm: torch.Tensor | None = None

    def copy_row(self, row: int, source: MambaState, source_row: int) -> None:
        self.conv = lazy_buffer(self.conv, self.cache, source.conv, slot_dim=None)
        self.ssm = lazy_buffer(self.ssm, self.cache, source.ssm, slot_dim=None)
        self.conv[row] = source.conv[source_row]
        self.ssm[row] = source.ssm[source_row]


def mamba2_head_split(module: nn.Module, opts: ShardOptions) -> ParallelStyle:
    """The mixer split by groups of heads: the parameters it names in `head_split_parameters` split
    on dim 0, and, with sequence parallelism, its input all-gathered from sequence slices on entry.
    Its linears take their own entries (mamba2_sharding)."""
    from titanlike.models.common.parallel_styles import HeadSplitParameters

    return HeadSplitParameters(protocol.head_split_parameters(module),
                               gather=gather_layouts(module) if opts.sequence_parallel else None)


def mamba2_sharding(name: str) -> dict[str, Style]:
    """The sharding-plan entries of a Mamba2Mixer at `name` in a block: in_proj colwise, out_proj
    rowwise, the mixer itself split by heads."""
    return {f"{name}.in_proj": colwise, f"{name}.out_proj": rowwise, name: mamba2_head_split}


__all__ = ["GatedRMSNorm", "Mamba2Args", "Mamba2Mixer", "MambaState", "causal_conv", "grouped_rows",
           "mamba2_head_split", "mamba2_sharding", "scan_implementation"]
