"""What a loss is as a function of the rows of its batch: an abstract interpretation of its jaxpr.

The loss is traced twice, on one microbatch and on the whole batch; the two
jaxprs must be the same program at two sizes (`pair`). An axis whose size
differs between them is a batch axis, and a literal or constant that differs is
a quantity of the batch (a count in `jnp.mean`). Every value gets a `Val`: what
it depends on (`params`: the differentiated arguments, through any path;
`folded`: a PRNG key argument, which each microbatch receives folded with its
index) and one of these tags:

* `INV`  free of rows, the same on a microbatch and on the whole batch;
* `ROW`  one batch axis, each row computed from the same row of the inputs
         (the microbatch's value is its block of the whole batch's);
* `MIX`  batch-only values with rows that are not row-local (an iota along
         the batch, a sort over it), no parameters;
* `COEF` free of rows, computed from the batch without the parameters: its
         whole-batch value is evaluated from the whole-batch trace;
* `SUM`  free of rows and additive: the whole batch's value is the sum of the
         microbatches' (a sum over rows, a literal zero);
* `LIN`  `sum_k c_k * S_k + r`: `S_k` sums, `c_k` coefficients (`COEF`, `INV`),
         `r` free of rows — computed after the microbatches, on the whole batch;
* `TERM` free of rows with parameters, through a coefficient (`l2 / n`);
* `TOP`  anything else; the first operation making one is recorded with why.

A loss tagged `SUM`, `LIN`, `TERM` or `INV` is exact (`spectrax_mpmd._trace.loss_head`);
`TOP` is refused, naming the operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import jax
import numpy as np

from .jax_private import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from .pruned import PER_OPERAND

INV, ROW, MIX, COEF, SUM, LIN, TERM, TOP = "inv", "row", "mix", "coef", "sum", "lin", "term", "top"
ROW_FREE_LINEAR = (SUM, LIN)


class Val(NamedTuple):
    tag: str
    params: bool = False
    zero: bool = False  # an invariant zero: also a valid sum (of no rows)
    folded: bool = False  # computed from a PRNG key argument (folded per microbatch by the step)


def val(tag: str, params: bool, zero: bool = False) -> Val:
    """`tag` normalised: without parameters, a row-free value is `INV` or `COEF`, a row value `ROW`
    or `MIX`."""
    if not params:
        if tag in (SUM, LIN, TERM):
            return Val(COEF)
        if tag == TOP:
            return Val(MIX)
    return Val(tag, params, zero and tag == INV and not params)


ELEMENTWISE = frozenset(
    """add sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh
    logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs integer_pow
    square erf erfc erf_inv lgamma digamma igamma igammac polygamma zeta bessel_i0e bessel_i1e not and or
    xor eq ne lt le gt ge select_n convert_element_type copy copy_p clamp nextafter real imag conj complex
    population_count clz shift_left shift_right_logical shift_right_arithmetic reduce_precision
    stop_gradient add_any bitcast_convert_type""".split()
)
IDENTITY = frozenset({"sharding_constraint", "device_put", "pvary"}) | PER_OPERAND
RANDOM = frozenset(
    {"random_bits", "random_wrap", "random_unwrap", "random_split", "random_fold_in", "random_seed"}
)
# linear in their row-free operands (the others: indices, predicates, pad values)
LINEAR_UNARY = frozenset(
    {
        "neg",
        "convert_element_type",
        "copy",
        "copy_p",
        "reshape",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "transpose",
        "reduce_sum",
        "slice",
        "rev",
        "reduce_precision",
        "real",
    }
    | IDENTITY
)
ADDITIVE = frozenset({"add", "sub", "add_any", "concatenate"})
AXIS_PARAMS = {  # operations along axes given by a parameter: row-local when the batch axis is not one
    "reduce_max": "axes",
    "reduce_min": "axes",
    "reduce_prod": "axes",
    "reduce_and": "axes",
    "reduce_or": "axes",
    "reduce_xor": "axes",
    "argmax": "axes",
    "argmin": "axes",
    "cumsum": "axis",
    "cumprod": "axis",
    "cummax": "axis",
    "cummin": "axis",
    "cumlogsumexp": "axis",
    "sort": "dimension",
    "rev": "dimensions",
    "split": "axis",
}


class StructureError(Exception):
    """The microbatch and whole-batch traces are not one program at two sizes."""


def _body(eqn: JaxprEqn, name: str):
    body = eqn.params[name]
    return (body.jaxpr, list(body.consts)) if isinstance(body, ClosedJaxpr) else (body, [])


def call_body(eqn: JaxprEqn):
    """`(jaxpr, consts)` of a call equation's body (a custom rule's primal)."""
    name = eqn.primitive.name
    return _body(eqn, "call_jaxpr" if name.startswith("custom") else "jaxpr")


@dataclass
class Blocker:
    eqn: JaxprEqn
    reason: str


@dataclass
class Analysis:
    """The tags of one micro/whole jaxpr pair (see the module docstring). `m`: microbatches; `rule`:
    the per-primitive rules (`spectrax_mpmd._trace.loss_rules.rule`)."""

    m: int
    rule: Callable  # `rule(analysis, micro eqn, whole eqn, input tags) -> output tags`
    whole_of: dict = field(default_factory=dict)  # micro var -> whole var (or literal)
    env: dict = field(default_factory=dict)
    blockers: dict = field(default_factory=dict)  # top-level equation index -> first Blocker in it
    _top: int | None = None

    # -- batch axes ------------------------------------------------------------------
    def axes(self, v) -> tuple[int, ...] | None:
        """The batch axes of micro value `v` (None when a size differs by other than `m`)."""
        w = self.whole_of.get(v, v) if isinstance(v, Var) else v
        mic, who = (
            v.aval.shape if hasattr(v.aval, "shape") else (),
            w.aval.shape if hasattr(w.aval, "shape") else (),
        )
        found = tuple(d for d, (a, b) in enumerate(zip(mic, who)) if a != b)
        if any(mic[d] * self.m != who[d] for d in found):
            return None
        return found

    def rows(self, v) -> bool:
        return self.axes(v) != ()

    # -- evaluation ------------------------------------------------------------------
    def read(self, v, w) -> Val:
        if isinstance(v, Literal):
            same = same_value(v.val, w.val)
            return Val(INV, zero=same and not np.any(np.asarray(v.val))) if same else Val(COEF)
        return self.env[v]

    def run(self, jm: Jaxpr, jw: Jaxpr, ins: list[Val], consts=((), ())) -> list[Val]:
        """Tag `jm`'s values (its whole-batch twin `jw`) from its inputs' tags; returns its outputs'."""
        if len(jm.eqns) != len(jw.eqns) or len(jm.invars) != len(jw.invars):
            raise StructureError("a different number of operations")
        for cm, cw, value_m, value_w in zip(jm.constvars, jw.constvars, *consts):
            same = same_value(value_m, value_w)
            self.env[cm] = Val(INV) if same else Val(COEF)
            self.whole_of[cm] = cw
        for vm, vw, tag in zip(jm.invars, jw.invars, ins):
            self.env[vm], self.whole_of[vm] = tag, vw
        top_level = self._top is None
        for k, (em, ew) in enumerate(zip(jm.eqns, jw.eqns)):
            if top_level:
                self._top = k
            if em.primitive.name != ew.primitive.name or len(em.outvars) != len(ew.outvars):
                raise StructureError(f"`{em.primitive.name}` against `{ew.primitive.name}`")
            for vm, vw in zip(em.outvars, ew.outvars):
                self.whole_of[vm] = vw
            outs = self.eqn(em, ew, [self.read(a, b) for a, b in zip(em.invars, ew.invars)])
            for v, tag in zip(em.outvars, outs):
                self.env[v] = tag
        if top_level:
            self._top = None
        return [self.read(a, b) for a, b in zip(jm.outvars, jw.outvars)]

    def block(self, eqn: JaxprEqn, params: bool, reason: str, rows: bool = True) -> Val:
        """The value of an operation the analysis cannot follow: batch-only values stay usable
        (evaluated on the whole batch), others are `TOP` and the first such operation is kept."""
        if not params:
            return Val(MIX if rows else COEF)
        self.blockers.setdefault(self._top, Blocker(eqn, reason))
        return Val(TOP, True)

    # -- one equation ----------------------------------------------------------------
    def eqn(self, em: JaxprEqn, ew: JaxprEqn, ins: list[Val]) -> list[Val]:
        if any(v.tag == TOP for v in ins):
            return [Val(TOP, True)] * len(em.outvars)
        outs = self.rule(self, em, ew, ins)
        if any(v.folded for v in ins):
            outs = [o._replace(folded=True) for o in outs]
        return outs


def _data(x) -> np.ndarray:
    """A literal or constant as numbers (a PRNG key as its key data)."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def same_value(a, b) -> bool:
    """Whether two literals or constants are equal (NaN equal to NaN)."""
    a, b = _data(a), _data(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    floating = np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)
    return bool(np.array_equal(a, b, equal_nan=floating))


def prefix_size(shape, axis: int) -> int:
    return math.prod(shape[:axis])
