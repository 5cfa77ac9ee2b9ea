"""Linear layers through oneDNN with prepacked weights, for generation on a CPU.

On a CPU, torch's F.linear calls MKL's sgemm; oneDNN (torch.ops.mkldnn, which inductor uses for
low-precision linears) computes the same product from a weight reordered once into its blocked
layout. On the AMD EPYC (Zen 4, AVX-512) these figures come from, MKL takes its AVX2 path and the
packed oneDNN product of a decode step's layers is 2.0-2.3x faster at 4 to 64 rows and 1.6x at one
(the weight shapes of scripts/bench_serve.py's model, one thread: docs/performance.md). The results
differ from F.linear's by the order of the sums only.

PackedLinears(model) finds the model's plain nn.Linear modules whose weight is an ordinary CPU tensor
of at least MIN_PACKED_WEIGHT numbers (not a DTensor shard, not a LoRA or Float8 module, which keep
their own forward) and, inside `with packed:`, routes their forward through the packed weight. The
pack is made when first needed, again when the weight's storage or version counter changed, and after refresh(). The version counter
does not see every update (torch's fused AdamW writes the parameters without counting, and neither
does a write through `.data`), so whoever may have changed the weights calls refresh(): Engine.generate
does at the start of every call (a policy trained between rollouts generates with its current
weights; repacking a 25M-parameter model takes ~60 ms on one core), a continuous batch, whose model
serves fixed weights, packs once. The forward falls back to F.linear where the packed product does not
apply: with autograd recording (training), inside a torch.compile trace (the compiled graph keeps
inductor's own matmul), or for an input of another dtype or device. Memory: one packed copy of every
such weight while the object lives.

Only one thread may run the model inside `with packed:` (the forwards are the modules' own
attributes while it is open): an engine's calls, which run on one thread, are what it wraps.
"""

from __future__ import annotations

from functools import partial, wraps

import torch
import torch.nn as nn
import torch.nn.functional as F

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# The packed product costs ~10 us a call whatever its size (oneDNN's dispatch), and a new row count
# builds a new primitive once (0.4-0.7 ms): below 256 x 256 weights MKL's product is faster at the
# row counts of a decode step (64 x 64: 1.8-6.8 us against 11-12 at 1-64 rows; 256 x 256 at 16 rows:
# 24 against 19 us; 512 x 512: 97 against 47), so smaller layers keep F.linear.
MIN_PACKED_WEIGHT = 256 * 256


def _packable(module: nn.Module) -> bool:
    if type(module) is not nn.Linear:
        return False
    weight = module.weight
    plain = type(weight) in (nn.Parameter, torch.Tensor)  # a DTensor shard is neither
    return plain and weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES \
        and weight.numel() >= MIN_PACKED_WEIGHT


class PackedLinears:
    """The packed forwards of a model's linear layers, active inside `with packed:`."""

    # The batch size oneDNN is told to choose its layout for: decode steps hold a few to a few
    # dozen rows, and a layout chosen for 16 is as fast at 1-64 rows as one chosen for each.
    LAYOUT_ROWS = 16

    def __init__(self, model: nn.Module):
        usable = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
        self.modules = [m for m in model.modules() if _packable(m)] if usable else []
        self._forwards = [partial(self._forward, m) for m in self.modules]
        self._packs: dict[nn.Module, tuple[tuple, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self.modules)

    def __enter__(self) -> PackedLinears:
        for module, forward in zip(self.modules, self._forwards):
            module.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)

    def refresh(self) -> None:
        """Forget the packs: the next forward of each layer packs its weight as it is then."""
        self._packs.clear()

    def wrap(self, fn):
        """fn, run with the packed forwards (fn itself when there is nothing to pack)."""
        if not self:
            return fn

        @wraps(fn)
        def packed(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return packed

    def _forward(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        weight = module.weight
        if x.dtype != weight.dtype and x.device.type == "cpu" and torch.is_autocast_enabled("cpu") \
                and torch.get_autocast_dtype("cpu") == weight.dtype:
            x = x.to(weight.dtype)  # what autocast's F.linear does with a weight already in its dtype
        if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.dtype != weight.dtype \
                or x.device.type != "cpu":
            return F.linear(x, weight, module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._pack(module), module.bias, "none", [], "")

    def _pack(self, module: nn.Linear) -> torch.Tensor:
        weight = module.weight
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype)
        held = self._packs.get(module)
        if held is None or held[0] != key:
            self._packs.pop(module, None)  # freed before the new pack is made
            held = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.LAYOUT_ROWS))
            self._packs[module] = held
        return held[1]


__all__ = ["MIN_PACKED_WEIGHT", "PACKED_DTYPES", "PackedLinears"]
