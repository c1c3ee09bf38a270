"""`spx.Policy`: the dtypes a module subtree computes and returns in.

`model.policy = spx.Policy(compute_dtype=jnp.bfloat16, output_dtype=jnp.float32)` (an
attribute `policy` holding anything else, e.g. a sub-module, is ordinary):
while `model` runs, the built-in layers below it (until one with its own
policy) cast their floating inputs and parameters to `compute_dtype`, and
`model`'s result is cast to `output_dtype`. The stored parameters keep their
dtype (`param_dtype` is what `storage_dtype` reports for code that builds
its own variables). A policy is a static attribute: changing it retraces.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from . import ambient


def _cast(tree: Any, dtype: Any) -> Any:
    """The floating arrays of `tree` as `dtype` (integer, boolean and key arrays unchanged)."""
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, jax.Array | jnp.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of a module subtree: `param_dtype` (storage, reported by `storage_dtype`),
    `compute_dtype` (layers' inputs and parameters), `output_dtype` (the module's result);
    None leaves that part as it is."""

    param_dtype: Any = None
    compute_dtype: Any = None
    output_dtype: Any = None

    def cast_param(self, x: Any) -> Any:
        """`x`'s floating arrays in `compute_dtype`."""
        return _cast(x, self.compute_dtype)

    def cast_output(self, x: Any) -> Any:
        """`x`'s floating arrays in `output_dtype`."""
        return _cast(x, self.output_dtype)

    def storage_dtype(self, fallback: Any) -> Any:
        """`param_dtype`, or `fallback` when it is None."""
        return self.param_dtype if self.param_dtype is not None else fallback


def current_policy() -> Policy | None:
    """The policy of the innermost running module that has one."""
    return ambient.current().policy


def push_policy(policy: Policy | None) -> contextlib.AbstractContextManager:
    """A block in which `policy` is current (None keeps the current one)."""
    if policy is None:
        return contextlib.nullcontext()
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a spx.Policy or None, received {policy!r}.")
    return ambient.setting("policy", policy)
