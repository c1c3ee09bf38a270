"""`sxstage_iter`: the stage-boundary marker, an identity primitive over a pytree."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

from ..errors import MarkerError
from .jax_private import Primitive, ad, batching, mlir

sxstage_iter_p = Primitive("sxstage_iter")
sxstage_iter_p.multiple_results = True
sxstage_iter_p.def_impl(lambda *xs, **_: list(xs))
sxstage_iter_p.def_abstract_eval(lambda *avals, **_: list(avals))
mlir.register_lowering(sxstage_iter_p, lambda ctx, *xs, **_: list(xs))


def _jvp(primals, tangents, **params):
    return sxstage_iter_p.bind(*primals, **params), list(tangents)


def _transpose(cts, *args, **params):
    return list(cts)


def _batch(args, dims, **params):
    return sxstage_iter_p.bind(*args, **params), dims


ad.primitive_jvps[sxstage_iter_p] = _jvp
ad.primitive_transposes[sxstage_iter_p] = _transpose
batching.primitive_batchers[sxstage_iter_p] = _batch


def _per_leaf_shardings(sharding: Any, n_leaves: int, treedef, stage: int | None) -> tuple:
    """One `PartitionSpec` (or None) per leaf of the marked value."""
    if sharding is None or isinstance(sharding, PartitionSpec):
        return (sharding,) * n_leaves
    marker = "sxstage_iter" if stage is None else f"sxstage_iter(stage={stage})"
    try:
        leaves = treedef.flatten_up_to(sharding)
    except (ValueError, TypeError) as err:
        raise MarkerError(
            f"{marker}: sharding= must be one PartitionSpec (or None) for every leaf, or a pytree "
            f"with the structure of the marked value; the value is {treedef} but sharding= is "
            f"{sharding!r} ({err}). Pass a single PartitionSpec, or mirror the value's structure "
            "with a PartitionSpec or None at each leaf."
        ) from None
    for s in leaves:
        if s is not None and not isinstance(s, PartitionSpec):
            raise MarkerError(
                f"{marker}: sharding leaves must be PartitionSpec or None, got {type(s).__name__} "
                f"({s!r}). Use jax.sharding.PartitionSpec(...) for each leaf."
            )
    return tuple(leaves)


def sxstage_iter(x: Any, *, stage: int | None = None, sharding: Any = None) -> Any:
    """Mark the end of a pipeline stage: `x` (a pytree) flows to the next stage.

    Identity everywhere (under jit, grad, vmap, scan); `sxjit` cuts the traced
    function at these markers. `stage` optionally names the stage that ends
    here (checked against the marker's position); `sharding` is the
    `PartitionSpec` (or a pytree of them matching `x`) of the activation on the
    receiving stage's submesh — default replicated.
    """
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    shardings = _per_leaf_shardings(sharding, len(leaves), treedef, stage)
    out = sxstage_iter_p.bind(*leaves, stage=stage, sharding=shardings)
    return jax.tree.unflatten(treedef, out)
