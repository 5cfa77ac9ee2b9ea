"""Layout-independent parameter initialization.

A model is built on the meta device, parallelized (FSDP2, tensor parallel, pipeline
stages that drop layers; parameters become DTensors), materialized with
`to_empty`, and only then initialized. We want the value of every parameter to
depend only on (seed, canonical FQN, model args): not on which other layers live on
this rank, not on the sharding, not on the order in which parameters are visited.
Otherwise a loss curve would change with the parallel layout, and parity tests
between layouts would be meaningless.

The global RNG cannot give that (its stream position depends on what was drawn
before, and on CPU there is no DTensor RNG tracker, so every shard would draw the
same numbers). So each parameter gets its own generator, seeded by a stable hash of
f"{seed}/{canonical_fqn}", draws the full (global-shape) tensor, and keeps only its
local shard. The cost is a transient full-size buffer per parameter on each rank.

Values are drawn in float32 and cast, so a bf16 model holds the rounded fp32 values.
They depend on the device type (CPU and CUDA generators differ), not on the device index.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from titanlike.models.common.dtensor import is_dtensor, local_part

# Prefixes inserted by wrappers (torch.compile, activation checkpointing, FSDP1)
# that must not change a parameter's identity.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canonical_fqn(fqn: str) -> str:
    """The parameter's name with wrapper modules removed, e.g. 'layers.3._orig_mod.attention.wq.weight' -> 'layers.3.attention.wq.weight'."""
    for prefix in _WRAPPER_PREFIXES:
        fqn = fqn.replace(prefix, "")
    return fqn


def seed_for(seed: int, fqn: str) -> int:
    """A 63-bit seed derived from (seed, canonical fqn); stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}/{canonical_fqn(fqn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_SKIP_META = contextvars.ContextVar("skip_meta", default=False)


@contextlib.contextmanager
def buffers_only():
    """Within it, initializing a meta tensor does nothing (rather than raise): a loader whose
    parameters all come from a checkpoint keeps them on meta and runs init_weights for what it
    rebuilds on the real device (the non-persistent buffers: RoPE tables, statistics), without
    drawing weights it would overwrite (checkpoint/hf.py load_model)."""
    token = _SKIP_META.set(True)
    try:
        yield
    finally:
        _SKIP_META.reset(token)


def _is_skipped(param: torch.Tensor) -> bool:
    return local_part(param).device.type == "meta" and _SKIP_META.get()


def _local_device(param: torch.Tensor) -> torch.device:
    local = local_part(param)
    if local.device.type == "meta":
        raise RuntimeError("cannot initialize a meta tensor: call model.to_empty(device=...) first")
    return local.device


@torch.no_grad()
def _fill_(param: torch.Tensor, draw: Callable[[torch.Tensor, torch.Generator], None],
           *, seed: int, fqn: str) -> torch.Tensor:
    if _is_skipped(param):
        return param
    device = _local_device(param)
    full = torch.empty(param.shape, dtype=torch.float32, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed_for(seed, fqn))
    draw(full, generator)
    return copy_full_(param, full)


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Copy the whole tensor `full` into `param`, or into this rank's shard of it (a DTensor): every
    rank holds `full`, so this only slices (no communication; uneven shards are fine)."""
    if _is_skipped(param):
        return param
    full = full.to(device=_local_device(param), dtype=param.dtype)
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank already holds the same full tensor.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
    return param


def normal_(param: torch.Tensor, *, std: float = 1.0, mean: float = 0.0,
            seed: int, fqn: str) -> torch.Tensor:
    return _fill_(param, lambda t, g: torch.nn.init.normal_(t, mean=mean, std=std, generator=g),
                  seed=seed, fqn=fqn)


def uniform_(param: torch.Tensor, *, low: float, high: float, seed: int, fqn: str) -> torch.Tensor:
    return _fill_(param, lambda t, g: t.uniform_(low, high, generator=g), seed=seed, fqn=fqn)


def trunc_normal_(param: torch.Tensor, *, std: float, mean: float = 0.0, a: float = -2.0,
                  b: float = 2.0, seed: int, fqn: str) -> torch.Tensor:
    """Normal(mean, std) truncated to [a, b]; note a and b are absolute values, as in torch.nn.init."""
    return _fill_(param, lambda t, g: torch.nn.init.trunc_normal_(t, mean=mean, std=std, a=a, b=b,
                                                                   generator=g),
                  seed=seed, fqn=fqn)


@torch.no_grad()
def constant_(param: torch.Tensor, value: float) -> torch.Tensor:
    # Constants need no RNG and are the same in every shard: fill the local part in place.
    if _is_skipped(param):
        return param
    _local_device(param)
    local_part(param).fill_(value)
    return param


def ones_(param: torch.Tensor) -> torch.Tensor:
    return constant_(param, 1.0)


def zeros_(param: torch.Tensor) -> torch.Tensor:
    return constant_(param, 0.0)


@dataclass(frozen=True)
class LinearInit:
    """How a family draws the weights of its linear layers (biases start at zero).

    std for projections that read the residual stream, out_std for those that write into it
    (families scale these down with depth); truncated draws from a normal cut at +-2 (absolute,
    as torch.nn.init and torchtitan), otherwise from a plain normal (GPT-2, Megatron).
    """

    std: float
    out_std: float
    truncated: bool = True

    def fill(self, weight: torch.Tensor, *, seed: int, fqn: str, output: bool = False) -> torch.Tensor:
        std = self.out_std if output else self.std
        if self.truncated:
            return trunc_normal_(weight, std=std, seed=seed, fqn=fqn)
        return normal_(weight, std=std, seed=seed, fqn=fqn)
