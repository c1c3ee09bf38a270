"""A stage's residuals: which of its vjp's leaves the backward reads, where each comes from, and
those it makes itself from the others.

A leaf that is a cell input (a parameter, a received activation) is read from its own buffer;
the forward returns the others. `jax.vjp` keeps what its pullback reads, including values the
forward derives elementwise from other kept values: tanh's `1 - y` beside `y`, the polynomial
terms of the tanh-approximated GELU beside its input, a second copy of a residual. Each such
value returned would cost a buffer per microbatch in flight, a write and a read per cell, and a
kernel in the forward program's compile; made in the backward instead, it fuses into the
kernels that read it. Only values that at most `MAX_EQNS` equations of exact elementwise
arithmetic (`EXACT`: no transcendental function, reduction or contraction) make from other kept
residuals and literals are left out: the backward binds the same primitives, with the same
parameters, on the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .jax_private import ClosedJaxpr, Literal
from .jaxpr import CALL_PRIMITIVES, eval_eqns, inline_calls, producers, read, resolve

EXACT = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "abs", "sign", "max", "min", "square", "integer_pow",
        "convert_element_type", "broadcast_in_dim", "copy", "select_n",
        "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    }
)  # fmt: skip
MAX_EQNS = 8


@dataclass(frozen=True)
class Residuals:
    """What a stage's backward reads (`avals`, each a cell input's position in `sources` or None
    where the forward returns it), the pullback's `treedef`, the positions among its leaves that
    are read (`kept`), and `rebuild` (the read ones -> every leaf)."""

    avals: list
    sources: tuple
    treedef: Any
    kept: tuple[int, ...]
    rebuild: Callable[[Sequence], list]


def inputs_as_residuals(in_avals: Sequence) -> Residuals:
    """The backward of a recomputed stage (`remat=True`) reads the cell's inputs, every one."""
    n = len(in_avals)
    return Residuals(list(in_avals), tuple(range(n)), None, tuple(range(n)), list)


def vjp_residuals(pullback_of: Callable, in_avals: Sequence) -> Residuals:
    """The residuals of `pullback_of(flat inputs)` (a `jax.vjp` pullback) on cell inputs shaped
    `in_avals`, from one trace: those left out are the ones `derived_residuals` finds."""
    found = []

    def probe(*flat):
        leaves, treedef = jax.tree.flatten(pullback_of(flat))
        found.append((tuple(_input_position(leaf, flat) for leaf in leaves), treedef))
        return leaves

    closed = jax.make_jaxpr(probe)(*in_avals)
    sources, treedef = found[0]
    derived = derived_residuals(closed, [k for k, src in enumerate(sources) if src is None])
    kept = derived.kept
    avals = [closed.out_avals[k] for k in kept]
    return Residuals(avals, tuple(sources[k] for k in kept), treedef, kept, derived.rebuild)


def _input_position(leaf, flat) -> int | None:
    """The position of `leaf` among the traced cell inputs `flat` (by identity), or None."""
    for k, x in enumerate(flat):
        if leaf is x:
            return k
    return None


@dataclass(frozen=True)
class Derived:
    """Of a vjp's residual leaves, the positions the forward keeps (`kept`) and `rebuild`, which
    makes every leaf, in order, from the kept ones."""

    kept: tuple[int, ...]
    rebuild: Callable[[Sequence], list]


def derived_residuals(closed: ClosedJaxpr, candidates: Collection[int]) -> Derived:
    """Which of the residual leaves `closed` returns (its outputs, in order) the backward can make
    itself: a position in `candidates` (the residuals the forward computes) whose value
    `MAX_EQNS` `EXACT` equations make from literals and the residuals not left out before it (a
    second copy of one is made by none). `rebuild` runs every equation so chosen in the jaxpr's
    order, so one made from a value left out after it finds that value made first."""
    eqns, mapping, _, _ = inline_calls(closed.jaxpr, lambda eqn: eqn.primitive.name in CALL_PRIMITIVES)
    outvars = [resolve(v, mapping) for v in closed.jaxpr.outvars]
    made_by = producers(eqns)
    left_out: dict[int, set[int]] = {}  # position -> the equations that make it

    def cone(v, available: set) -> set[int] | None:
        """The equations making `v` from `available` and literals, or None past the rule."""
        found: set[int] = set()
        stack = [v]
        while stack:
            u = stack.pop()
            if isinstance(u, Literal) or u in available:
                continue
            k = made_by.get(u)
            if k is None or eqns[k].primitive.name not in EXACT or len(eqns[k].outvars) != 1:
                return None
            if k not in found:
                found.add(k)
                if len(found) > MAX_EQNS:
                    return None
                stack.extend(eqns[k].invars)
        return found

    for position in sorted(candidates):
        kept_now = (v for k, v in enumerate(outvars) if k != position and k not in left_out)
        made = cone(outvars[position], {v for v in kept_now if not isinstance(v, Literal)})
        if made is not None:
            left_out[position] = made
    kept = tuple(k for k in range(len(outvars)) if k not in left_out)
    recompute = [eqns[k] for k in sorted(set().union(*left_out.values()))]
    kept_vars = [outvars[k] for k in kept]

    def rebuild(values: Sequence) -> list:
        env = dict(zip(kept_vars, values))
        eval_eqns(recompute, env)
        return [read(env, v) for v in outvars]

    return Derived(kept, rebuild)
