"""`eager_only`: torch.compiler.disable, made when the function first runs rather than at import.

torch.compiler.disable imports torch._dynamo (about a second of CPU on a 2-core machine), which a
decorator at module level makes every command pay, `--help` included (docs/performance.md). The
function is marked as torch.compiler.disable marks it (the `_torchdynamo_disable` attribute that
torch/_dynamo/eval_frame.py's DisableContext sets and dynamo checks before inlining), so a trace
that reaches it skips it, as it skips a disabled one; the first call makes the disabled function,
by which time anything compiling has imported dynamo anyway.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager_only(fn: F) -> F:
    """fn, never traced by torch.compile: what `@torch.compiler.disable` gives, without importing
    torch._dynamo until fn runs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        disabled = wrapper.__dict__.get("_disabled")
        if disabled is None:
            disabled = wrapper._disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    wrapper._torchdynamo_disable = True
    return wrapper  # type: ignore[return-value]


__all__ = ["eager_only"]
