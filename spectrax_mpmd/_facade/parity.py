"""`check_parity`: run a built step and the same computation unsplit, and say how far apart they are.

The first thing to run on a new model: one call compares the pipelined step
with its unsplit reference (`jax.jit` on one device) on one batch, leaf by leaf,
as relative L2 distances: the loss, the aux outputs, the gradients and, for a
one-plan step (`sxvalue_and_grad_and_apply`), the updated parameters and
optimizer state. Neither the caller's arrays nor the step's cache change: the
step runs on copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._api.grad import _StepFunction
from ..errors import MpmdError
from .gather import gather


@dataclass(frozen=True)
class ParityRow:
    """One leaf: its group (`loss`, `aux`, `grads`, `params`, `opt_state`), path and shape, and
    `||step - unsplit|| / ||unsplit||` (None when the shapes differ, e.g. aux stacked per
    microbatch)."""

    group: str
    path: str
    shape: tuple
    rel_l2: float | None


@dataclass(frozen=True)
class Parity:
    """The per-leaf distances between a step and its unsplit reference; `print` it for the table."""

    rows: tuple[ParityRow, ...]

    @property
    def worst(self) -> float:
        """The largest relative L2 distance over the compared leaves."""
        return max((r.rel_l2 for r in self.rows if r.rel_l2 is not None), default=0.0)

    def ok(self, rtol: float = 1e-5) -> bool:
        """Whether every compared leaf is within `rtol` (relative L2)."""
        return self.worst <= rtol

    def __str__(self) -> str:
        width = max((len(r.group) + len(r.path) for r in self.rows), default=10) + 2
        lines = [f"{'leaf':{width}}  {'shape':>14}  relative L2"]
        for r in self.rows:
            why = "stacked per microbatch" if r.group == "aux" else "shapes differ"
            d = f"n/a ({why})" if r.rel_l2 is None else f"{r.rel_l2:.2e}"
            lines.append(f"{r.group + r.path:{width}}  {str(r.shape):>14}  {d}")
        lines.append(f"worst: {self.worst:.2e}")
        return "\n".join(lines)


def _distance(got, want) -> float | None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return None
    scale = np.linalg.norm(want)
    diff = np.linalg.norm(got - want)
    return float(diff / scale) if scale > 0 else float(diff)


def _rows(groups: tuple, got, want) -> list[ParityRow]:
    rows = []
    for group, g, w in zip(groups, got, want):
        if isinstance(group, tuple):  # a pair of results, e.g. (loss, aux)
            rows += _rows(group, g, w)
            continue
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(w)):
            if jnp.issubdtype(jnp.result_type(b), jnp.inexact):
                rows.append(ParityRow(group, jax.tree_util.keystr(path), tuple(np.shape(b)), _distance(a, b)))
    return rows


def reference_of(step) -> Callable | None:
    """The unsplit computation of a built step: `jax.value_and_grad` (or `jax.grad`) of a
    `sxvalue_and_grad` (`sxgrad`) step's function; the one-plan step's own (`unsplit`)."""
    if isinstance(step, _StepFunction):
        transform = jax.value_and_grad if step.value else jax.grad
        return transform(step.fn, argnums=step.given_argnums, has_aux=step.has_aux)
    return getattr(step, "unsplit", None)


def groups_of(step) -> tuple:
    """What each of a step's results is: `loss` (with `aux`), `grads`, `params`, `opt_state`."""
    if not isinstance(step, _StepFunction):
        return step.parity_groups
    if step.value:
        return (("loss", "aux") if step.has_aux else "loss", "grads")
    return (("grads", "aux"),) if step.has_aux else ("grads",)


def _on_one_device(tree):
    """`tree` with its arrays gathered to one device (other leaves as they are)."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array)]
    for k, x in zip(where, gather([leaves[k] for k in where])):
        leaves[k] = x
    return jax.tree.unflatten(treedef, leaves)


def check_parity(step: Callable, *args, reference: Callable | None = None) -> Parity:
    """Run `step(*args)` and its unsplit reference on the same arguments and compare every floating
    leaf of their results (relative L2). `step` is a `sxvalue_and_grad`, `sxgrad` or
    `sxvalue_and_grad_and_apply` step; `reference` (default: the step's own function under
    `jax.value_and_grad`, then `tx` for a one-plan step, as one `jax.jit` on one device) takes the
    same arguments and returns the same structure."""
    unsplit = reference_of(step)
    if reference is None and unsplit is None:
        raise MpmdError(
            "check_parity: step must be built by sxvalue_and_grad, sxgrad or sxvalue_and_grad_and_apply "
            f"(got {type(step).__name__}); for another callable pass reference=, a function of the same "
            "arguments returning the same structure."
        )
    groups, static = groups_of(step), getattr(step, "static_argnums", ())
    copies = jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, args)
    want = jax.jit(reference or unsplit, static_argnums=static)(*_on_one_device(args))
    got = step(*copies)
    got, want = (got, want) if len(groups) > 1 else ((got,), (want,))
    return Parity(tuple(_rows(groups, _on_one_device(got), _on_one_device(want))))
