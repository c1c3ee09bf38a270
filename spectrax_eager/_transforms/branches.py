"""`cond` and `switch` over modules: the operands may hold modules, read by every branch, and the
writes `mutable=` allows come back as outputs of the branch taken."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from .lift import Split, allowed, fn_name, pure_call, write_allowed


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any, mutable: Any = None) -> Any:
    """`jax.lax.cond` where the operands may contain modules; writes allowed by `mutable` come back."""
    split = Split(operands, {})
    ok = allowed(split.plan, mutable)
    branches = [
        pure_call(b, split, ok, f"spx.cond({fn_name(b)})", mutable, True) for b in (false_fun, true_fun)
    ]
    out, new = jax.lax.cond(pred, branches[1], branches[0], split.values, split.leaves)
    write_allowed(split, ok, new)
    return out


def switch(index: Any, branches: Sequence[Callable], *operands: Any, mutable: Any = None) -> Any:
    """`jax.lax.switch` where the operands may contain modules; writes allowed by `mutable` come back."""
    split = Split(operands, {})
    ok = allowed(split.plan, mutable)
    pures = [pure_call(b, split, ok, f"spx.switch({fn_name(b)})", mutable, True) for b in branches]
    out, new = jax.lax.switch(index, pures, split.values, split.leaves)
    write_allowed(split, ok, new)
    return out
