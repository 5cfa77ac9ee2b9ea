"""The weights a model trained in float32 under bf16 autocast generates from (the engine's `dtype`).

One process under bf16 mixed precision keeps float32 weights and computes its matmuls in bf16 (autocast,
train/plan.py PrecisionPlan.autocast_dtype); an engine generating from those weights as they are would
decode in float32, another computation than the step's and twice the bytes. As an inference engine
beside a trainer holds its own bf16 weights, the engine holds bf16 copies of the linear layers' weights
and runs under the same autocast (inference/engine.py Engine(dtype=)).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn


class LowPrecisionCopy:
    """What a model trained in float32 under autocast (one process, bf16 mixed precision) generates from:
    its linear layers' weights copied once in the autocast dtype, every other parameter the model's own
    (shared, not copied), the engine's steps run under the same autocast. autocast casts a linear layer's
    float32 weight to bf16 at every matmul; the copy holds that cast already, so the engine computes what
    the training step computes (an embedding lookup, a norm, experts' weights: as autocast runs them) while
    a decode step reads 2 bytes of each linear weight instead of 4 read + 2 written + 2 read. refresh()
    copies the model's linear weights in (one cast, ~1 ms at 1B on a GPU) into the same tensors, so a
    CUDA graph recorded over them stays valid. Costs 2 bytes a linear parameter."""

    def __init__(self, source: nn.Module, dtype: torch.dtype):
        if not LowPrecisionCopy.possible(source):
            raise ValueError("a low-precision copy is made of one process's model, not of a sharded one")
        self.dtype = dtype
        # deepcopy takes every parameter from the memo: a linear layer's made directly in dtype (the float32
        # copy never exists), any other the source's own. A weight a linear layer shares with another module
        # (an embedding tied to the output) is the other's here; the copy's linear layer gets its own below.
        elsewhere = {id(p) for m in source.modules() if not isinstance(m, nn.Linear)
                     for p in m.parameters(recurse=False)}
        memo = {id(p): p for p in source.parameters()}
        for m in source.modules():
            if isinstance(m, nn.Linear):
                for p in m.parameters(recurse=False):
                    if id(p) not in elsewhere:
                        memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=False)
        self.model = copy.deepcopy(source, memo)  # a block's compiled call is not copied (Module.__getstate__)
        self.pairs = []
        for name, module in self.model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            theirs = source.get_submodule(name)
            for key, param in list(module.named_parameters(recurse=False)):
                if param.dtype != dtype:  # tied to an embedding: the output layer's own bf16 weight
                    param = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                    setattr(module, key, param)
                self.pairs.append((param, getattr(theirs, key)))
        self.model.eval()

    @staticmethod
    def possible(source: nn.Module) -> bool:
        """One process's model: no DTensor parameters (under FSDP the mixed-precision policy gathers
        bf16 weights already; a tensor-parallel model generates in its own dtype)."""
        from torch.distributed.tensor import DTensor

        return not any(isinstance(p, DTensor) for p in source.parameters())

    def autocast(self, fn):
        """fn under the training step's autocast (inside a compiled step too: dynamo traces the context)."""
        device, dtype = next(self.model.parameters()).device.type, self.dtype

        @functools.wraps(fn)
        def cast(*args, **kwargs):
            with torch.autocast(device, dtype=dtype):
                return fn(*args, **kwargs)

        return cast

    @torch.no_grad()
    def refresh(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)


__all__ = ["LowPrecisionCopy"]
