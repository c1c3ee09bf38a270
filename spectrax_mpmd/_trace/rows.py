"""Rows of stacked values computed from only the rows' own inputs.

An init that stacks blocks draws each parameter for every block at once (`vmap` of a
block's init over split keys), and a pipeline rank keeps a slice of the stack. Computing
the whole stack to slice it repeats every rank's draw on every rank: each rank's
temporaries hold the whole stack, and ranks keeping the same shapes at different rows run
programs that differ only in a constant. `rows_program` pushes each output's slice
back through the equations that act row by row (elementwise arithmetic, broadcasts,
slices, reshapes that keep the leading axes, iota, and JAX's PRNG primitives, which draw
each key's bits from that key alone), so a rank computes its own rows only. Values are
unchanged: every pushed equation computes each element from the same elements of its
inputs. Where a rule does not apply the value is computed whole and sliced there.

The slices of the outputs start at positions passed in as an argument (`offsets`), so
ranks whose programs differ only in which rows they keep run the same program: it
compiles once. The program's random draws are hashed without JAX's CPU loop (`draws`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from .draws import HASHED, draw, hashable
from .jax_private import ClosedJaxpr, JaxprEqn, Literal, Var
from .jaxpr import inline_calls, read, resolve
from .pruned import needed_inputs, run_wanted

ROW_WISE = frozenset({
    "abs", "add", "and", "atan2", "bitcast_convert_type", "cbrt", "ceil", "clamp", "convert_element_type",
    "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge",
    "gt", "integer_pow", "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "nextafter", "not", "or", "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor",
})  # fmt: skip
PER_KEY = frozenset({"random_bits", "random_split", "random_unwrap", "random_wrap"})


class Rows(NamedTuple):
    """Rows `start .. start + size - 1` of axis `axis`; `slot`: the index of an offset added to
    `start` at run time (None: `start` alone)."""

    axis: int
    slot: int | None
    start: int
    size: int


def _shape(v) -> tuple:
    return tuple(v.aval.shape)


def _narrowed(shape: Sequence[int], rows: Rows) -> tuple:
    return tuple(rows.size if k == rows.axis else d for k, d in enumerate(shape))


def _one_axis_slice(eqn: JaxprEqn) -> Rows | None:
    """The rows a slice keeps when it cuts one axis with stride 1, else None."""
    p, shape = eqn.params, _shape(eqn.invars[0])
    cut = [
        k
        for k, (a, b, d) in enumerate(zip(p["start_indices"], p["limit_indices"], shape))
        if (a, b) != (0, d)
    ]
    if len(cut) != 1 or (p["strides"] is not None and p["strides"][cut[0]] != 1):
        return None
    a = cut[0]
    return Rows(a, None, p["start_indices"][a], p["limit_indices"][a] - p["start_indices"][a])


def operand_rows(eqn: JaxprEqn, rows: Rows) -> list | None:
    """Per operand of `eqn`, the rows its output's `rows` read (None: the whole operand), or
    None when `eqn` cannot be computed on rows."""
    name, out = eqn.primitive.name, eqn.outvars[0]
    ins = eqn.invars
    if name in ROW_WISE:  # operands of the output's shape, a scalar, or size 1 along broadcast axes
        return (
            [_row_wise(_shape(v), _shape(out), rows) for v in ins]
            if all(_fits(v, out) for v in ins)
            else None
        )
    if name in PER_KEY:
        return [rows] if rows.axis < len(_shape(out)) - _trailing(eqn) else None
    if name == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        if rows.axis in dims:
            k = dims.index(rows.axis)
            if _shape(ins[0])[k] == _shape(out)[rows.axis]:
                return [rows._replace(axis=k), *([None] * (len(ins) - 1))]
        return [None] * len(ins)
    if name == "slice":
        p = eqn.params
        if p["strides"] is not None and p["strides"][rows.axis] != 1:
            return None
        return [rows._replace(start=rows.start + p["start_indices"][rows.axis])]
    if name == "squeeze":
        kept = [k for k in range(len(_shape(ins[0]))) if k not in eqn.params["dimensions"]]
        return [rows._replace(axis=kept[rows.axis])]
    if name == "transpose":
        return [rows._replace(axis=eqn.params["permutation"][rows.axis])]
    if name == "reshape":
        head = rows.axis + 1
        same = _shape(ins[0])[:head] == _shape(out)[:head] and eqn.params.get("dimensions") is None
        return [rows, *([None] * (len(ins) - 1))] if same else None
    if name == "iota":
        return []
    return None


def _fits(v, out) -> bool:
    shape, full = _shape(v), _shape(out)
    return shape == () or (len(shape) == len(full) and all(a in (1, b) for a, b in zip(shape, full)))


def _row_wise(shape: tuple, full: tuple, rows: Rows) -> Rows | None:
    return rows if shape != () and shape[rows.axis] == full[rows.axis] else None


def _trailing(eqn: JaxprEqn) -> int:
    """How many trailing axes of a PRNG primitive's output are not the keys' batch axes."""
    name, out = eqn.primitive.name, eqn.outvars[0]
    if name == "random_wrap":
        return 0
    return len(_shape(out)) - len(_shape(eqn.invars[0]))


class Narrowing(NamedTuple):
    """What `rows_program` decided: the flat equations, the rows each variable is computed on
    (absent: whole), each narrowed equation's operand rows, the outputs each equation computed
    whole must give, the offsets' values, and per output whether it is a slice starting at an
    offset (its program is then the same for every other start)."""

    eqns: list
    consts: dict
    invars: list
    targets: list
    rows: dict
    reads: dict
    whole: dict
    offsets: tuple
    sliced: tuple


def plan(closed: ClosedJaxpr, outputs: Sequence[int]) -> Narrowing:
    """Decide, backwards from `closed`'s outputs `outputs`, which variables are computed on rows."""
    eqns, mapping, consts, _ = inline_calls(closed.jaxpr, lambda eqn: True)
    consts |= dict(zip(closed.jaxpr.constvars, closed.consts))
    targets = [resolve(closed.jaxpr.outvars[k], mapping) for k in outputs]
    demands: dict = {}
    slots: dict[int, int] = {}

    def demand(v, rows) -> None:
        if isinstance(v, Var) and not isinstance(v, Literal):
            demands.setdefault(v, set()).add(rows)

    for t in targets:
        demand(t, None)
    rows_of: dict = {}
    reads: dict = {}
    whole: dict = {}
    sliced: set = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        wanted = [v in demands for v in eqn.outvars]
        if not any(wanted):
            continue
        found = demands[eqn.outvars[0]] if len(eqn.outvars) == 1 else {None}
        rows = next(iter(found)) if len(found) == 1 else None
        if rows is None and eqn.outvars[0] in targets and eqn.primitive.name == "slice":
            cut = _one_axis_slice(eqn)
            if cut is not None:  # an output's own slice: its start becomes an offset
                reads[i] = [cut._replace(slot=slots.setdefault(cut.start, len(slots)), start=0)]
                sliced.add(eqn.outvars[0])
                demand(eqn.invars[0], reads[i][0])
                continue
        per_operand = operand_rows(eqn, rows) if rows is not None else None
        if per_operand is None:
            whole[i] = wanted
            for v, n in zip(eqn.invars, needed_inputs(eqn, wanted)):
                if n:
                    demand(v, None)
            continue
        rows_of[eqn.outvars[0]] = rows
        reads[i] = per_operand
        for v, r in zip(eqn.invars, per_operand):
            demand(v, r)
    offsets = tuple(sorted(slots, key=slots.get))
    at_offsets = tuple(isinstance(t, Var) and not isinstance(t, Literal) and t in sliced for t in targets)
    return Narrowing(eqns, consts, list(closed.jaxpr.invars), targets, rows_of, reads, whole, offsets, at_offsets)


def _start(rows: Rows, offsets):
    return rows.start if rows.slot is None else offsets[rows.slot] + rows.start


def _cut(x, rows: Rows, offsets):
    """`rows` of a whole value `x`."""
    if rows.slot is None:
        return lax.slice_in_dim(x, rows.start, rows.start + rows.size, axis=rows.axis)
    return lax.dynamic_slice_in_dim(x, _start(rows, offsets), rows.size, axis=rows.axis)


def _bind(eqn: JaxprEqn, rows: Rows, vals: list, offsets):
    """`eqn`'s output on `rows`, from its operands on the rows `operand_rows` gave."""
    name, params = eqn.primitive.name, dict(eqn.primitive.get_bind_params(eqn.params))
    shape = _narrowed(_shape(eqn.outvars[0]), rows)
    if name == "slice":
        params["start_indices"] = tuple(
            0 if k == rows.axis else s for k, s in enumerate(params["start_indices"])
        )
        params["limit_indices"] = tuple(
            rows.size if k == rows.axis else s for k, s in enumerate(params["limit_indices"])
        )
    elif name in ("broadcast_in_dim", "iota"):
        params["shape"] = shape
    elif name == "reshape":
        params["new_sizes"] = shape
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    if name == "iota" and params["dimension"] == rows.axis:
        out = out + jnp.asarray(_start(rows, offsets), params["dtype"])
    return out


def rows_program(closed: ClosedJaxpr, outputs: Sequence[int]) -> tuple[Callable, tuple[int, ...]]:
    """`(fn, offsets)`: `fn(offsets, *inputs)` gives `closed`'s outputs `outputs` computing each
    stacked value on only the rows they keep; `offsets` are the starts to pass (int32)."""
    narrowing = plan(closed, outputs)
    return (lambda offsets, *inputs: evaluate(narrowing, offsets, inputs)), narrowing.offsets


def evaluate(n: Narrowing, offsets, inputs: Sequence) -> tuple:
    """Run the narrowed program `n` on `inputs` with the output slices starting at `offsets`."""
    env = dict(n.consts) | dict(zip(n.invars, inputs))

    def get(v, rows):
        x = read(env, v)
        return x if rows is None or n.rows.get(v) == rows else _cut(x, rows, offsets)

    for i, eqn in enumerate(n.eqns):
        if i not in n.whole and i not in n.reads:
            continue
        vals = [get(v, r) for v, r in zip(eqn.invars, n.reads[i])] if i in n.reads else None
        if eqn.primitive.name in HASHED:  # a draw on its rows or whole: its params are the same
            keys = read(env, eqn.invars[0]) if vals is None else vals[0]
            if hashable(eqn.primitive.name, keys, eqn.params):
                env[eqn.outvars[0]] = draw(eqn.primitive.name, keys, eqn.params)
                continue
        if vals is None:
            run_wanted(eqn, n.whole[i], env)
        else:
            rows = n.rows.get(eqn.outvars[0])
            env[eqn.outvars[0]] = vals[0] if rows is None else _bind(eqn, rows, vals, offsets)
    return tuple(read(env, t) for t in n.targets)
