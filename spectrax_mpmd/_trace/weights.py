"""How a training step weighs its microbatches' losses, so that it equals the unsplit loss.

A step's loss is `sum_i c_i * L_i` over microbatches `i`, each `L_i` the loss
function on microbatch `i`. Three rules set the coefficients `c_i`:

* **Factors of the batch** (`reduce="mean"`, the default). A loss that ends
  in a chain of scalings by values computed without the parameters —
  `jnp.mean(x)` (a sum divided by a count), a padded token mean
  `jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)`, `0.5 * jnp.mean(err)`,
  `jnp.sum(x) * (1 / n_tokens)` — is cut at that chain: each stage program
  computes the microbatch's unscaled loss (the chain's factors set to one) and
  `c` is the chain's factors evaluated on the *whole* batch. The step is then
  the unsplit loss whenever the unscaled loss adds up over examples (a sum of
  per-example or per-token terms), whatever each microbatch holds.
* **User weights** (`microbatch_weight_fn=w`, `w` with the loss function's
  signature, evaluated on each microbatch's slice of the batch arguments):
  `c_i = w_i / sum_j w_j`.
* **Otherwise** the declared reduction: `1/m` (`"mean"`) or `1` (`"sum"`).

A loss that scales by a batch-computed scalar anywhere else (`token_mean +
0.01 * l2`, a normalisation by a batch statistic) depends on how the batch is
cut, so it is refused with an error naming `microbatch_weight_fn`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import MpmdError
from .args import fold_key
from .graph import StageGraph
from .jax_private import ClosedJaxpr, Literal, Var
from .jaxpr import CALL_PRIMITIVES, eval_eqns, inline_calls, needed_eqns, producers, read
from .marker import sxstage_iter_p

PARAM, BATCH, OTHER = 1, 2, 4  # what a value depends on: bit flags over the argument kinds
_PASS_THROUGH = frozenset({"neg", "convert_element_type", "copy"})
_REBROADCAST = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "copy"})


@dataclass(frozen=True, eq=False)
class Subprogram:
    """Equations of a traced function computing some values from some of its flat leaves."""

    eqns: tuple
    inputs: tuple[tuple[int, Var], ...]  # (flat leaf, its variable), the leaves it reads
    outputs: tuple
    consts: dict

    @classmethod
    def of(cls, closed: ClosedJaxpr, outputs: Sequence) -> "Subprogram":
        jaxpr = closed.jaxpr
        eqns = [jaxpr.eqns[k] for k in sorted(needed_eqns(jaxpr.eqns, outputs))]
        used = {v for e in eqns for v in e.invars if isinstance(v, Var)} | {
            v for v in outputs if isinstance(v, Var)
        }
        inputs = tuple((a, v) for a, v in enumerate(jaxpr.invars) if v in used)
        return cls(tuple(eqns), inputs, tuple(outputs), dict(zip(jaxpr.constvars, closed.consts)))

    @property
    def reads(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.inputs)

    def __call__(self, leaves: dict) -> list:
        env = dict(self.consts)
        env.update((v, leaves[a]) for a, v in self.inputs)
        eval_eqns(self.eqns, env)
        return [read(env, v) for v in self.outputs]


@dataclass(frozen=True, eq=False)
class LossWeights:
    """The coefficient of each microbatch's loss (see the module docstring)."""

    reduce: str = "mean"
    factors: Subprogram | None = None  # the chain's factors over the whole batch
    divides: tuple[bool, ...] = ()  # per factor: a divisor (else a multiplier)
    weight: Subprogram | None = None  # the user's weight of one microbatch
    keys: frozenset = frozenset()  # broadcast leaves folded per microbatch

    @property
    def reads(self) -> tuple[int, ...]:
        """The flat leaves the coefficient reads (batch leaves whole, broadcast leaves as given)."""
        return tuple(
            sorted(
                {*(self.factors.reads if self.factors else ()), *(self.weight.reads if self.weight else ())}
            )
        )

    @property
    def is_default(self) -> bool:
        return self.factors is None and self.weight is None

    def coefficient(self, leaves: dict, batch, idx, m: int):
        """Microbatch `idx`'s coefficient, a float32 scalar, from the whole-batch `leaves` (`batch`:
        which of them are batch leaves); None for the declared reduction (see `scale`)."""
        if self.is_default:
            return None
        if self.factors is not None:
            c = jnp.float32(1)
            for value, divides in zip(self.factors(leaves), self.divides):
                value = jnp.asarray(value, jnp.float32)
                c = c / value if divides else c * value
            return c
        weights = self.all_weights(leaves, frozenset(batch), m)
        return weights[idx] / jnp.sum(weights)

    def scaler(self, io, X: list, Bf: list, idx, m: int) -> Callable:
        """`loss -> loss weighed` inside a loss stage's cell (`io`: its `StageIO`; `X`, `Bf`: its
        broadcast and whole batch leaves; `idx`: the microbatch)."""
        coefficient = self.coefficient(dict(zip(io.batch, Bf)) | dict(zip(io.fixed, X)), io.batch, idx, m)
        return lambda loss: self.scale(loss, coefficient, m)

    def scale(self, loss, coefficient, m: int):
        """`loss` times its microbatch's `coefficient` (None: divided by `m` for `"mean"`)."""
        if coefficient is None:
            return loss / m if self.reduce == "mean" else loss
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)) * coefficient

    def all_weights(self, leaves: dict, batch: frozenset, m: int):
        """The user's weight of every microbatch, float32 `[m]`."""

        def one(j, sliced):
            own = dict(leaves) | sliced
            own.update((a, fold_key(leaves[a], j)) for a in self.keys if a in own)
            return jnp.asarray(self.weight(own)[0], jnp.float32)

        split = {a: leaves[a].reshape(m, -1, *leaves[a].shape[1:]) for a in self.weight.reads if a in batch}
        return jax.vmap(one)(jnp.arange(m), split)


def _propagate(eqn, flags: dict) -> list[int]:
    """Record the flags of `eqn`'s outputs in `flags` (a stage marker is the identity: each
    output depends on its own input only); returns its inputs' flags."""
    ins = [flags.get(v, 0) if not isinstance(v, Literal) else 0 for v in eqn.invars]
    if eqn.primitive is sxstage_iter_p:
        flags.update(zip(eqn.outvars, ins))
    else:
        merged = 0
        for f in ins:
            merged |= f
        flags.update((v, merged) for v in eqn.outvars)
    return ins


def _flags(closed: ClosedJaxpr, kinds: dict, eqns=None) -> dict:
    """Per variable: the kinds of arguments it depends on (`PARAM | BATCH | OTHER`)."""
    flags = {v: kinds.get(a, OTHER) for a, v in enumerate(closed.jaxpr.invars)}
    for eqn in closed.jaxpr.eqns if eqns is None else eqns:
        _propagate(eqn, flags)
    return flags


@dataclass(frozen=True)
class Chain:
    """The equations that end a loss, outermost first: `(equation index, position of the operand
    carrying the loss, position of the factor or None, divides)` each."""

    path: tuple[tuple[int, int, int | None, bool], ...]
    batch_scaled: bool = False  # a factor is computed from the batch

    @property
    def factors(self) -> tuple[tuple[int, int, bool], ...]:
        """`(equation index, factor position, divides)` of each scaling."""
        return tuple((k, f, d) for k, _, f, d in self.path if f is not None)

    def values(self, closed: ClosedJaxpr) -> list:
        return [closed.jaxpr.eqns[k].invars[pos] for k, pos, _ in self.factors]


def loss_chain(closed: ClosedJaxpr, kinds: dict) -> Chain:
    """The chain of parameter-free scalings (multiplications, divisions; through negations and
    float casts) that ends the loss, outermost first."""
    jaxpr = closed.jaxpr
    made = producers(jaxpr.eqns)
    flags = _flags(closed, kinds)
    path, v = [], jaxpr.outvars[0]
    while isinstance(v, Var) and v in made:
        k = made[v]
        eqn = jaxpr.eqns[k]
        name = eqn.primitive.name
        free = [not isinstance(x, Var) or not flags.get(x, 0) & PARAM for x in eqn.invars]
        if name in _PASS_THROUGH and len(eqn.invars) == 1:
            path.append((k, 0, None, False))
        elif name == "div" and free[1] and not free[0]:
            path.append((k, 0, 1, True))
        elif name == "mul" and free.count(True) == 1:
            pos = free.index(True)
            path.append((k, 1 - pos, pos, False))
        else:
            break
        v = eqn.invars[path[-1][1]]
    while path and path[-1][2] is None:  # casts below the innermost factor stay in the loss
        path.pop()
    factors = [jaxpr.eqns[k].invars[f] for k, _, f, _ in path if f is not None]
    return Chain(tuple(path), any(isinstance(v, Var) and flags.get(v, 0) & BATCH for v in factors))


def _batch_scaled(closed: ClosedJaxpr, kinds: dict, skip: set) -> list[str]:
    """Scalars computed from batch arguments without the parameters that multiply or divide a
    value carrying the parameters on the loss's path, outside the equations making the
    variables `skip` (the loss's own chain): the loss then depends on how the batch is cut.
    Returns a description of each."""
    eqns, mapping, _, _ = inline_calls(closed.jaxpr, lambda e: e.primitive.name in CALL_PRIMITIVES)
    loss = mapping.get(closed.jaxpr.outvars[0], closed.jaxpr.outvars[0])
    cone = needed_eqns(eqns, [loss])
    flags = _flags(closed, kinds, ())
    stats: set = set()  # batch statistics: parameter-free scalars of the batch, and their broadcasts
    found = []
    for k, eqn in enumerate(eqns):
        ins = _propagate(eqn, flags)
        stat = [
            isinstance(v, Var) and (v in stats or (v.aval.shape == () and f & BATCH and not f & PARAM))
            for v, f in zip(eqn.invars, ins)
        ]
        name = eqn.primitive.name
        if name in _REBROADCAST and stat and stat[0]:
            stats.update(eqn.outvars)
        elif name in ("mul", "div") and k in cone and any(stat) and not set(eqn.outvars) & skip:
            if any(f & PARAM for f, s in zip(ins, stat) if not s):
                found.append(f"`{name}` by a {eqn.invars[stat.index(True)].aval.str_short()} of the batch")
    return found


def _literal_one(v):
    return Literal(np.ones(v.aval.shape, v.aval.dtype), v.aval)


def unscaled(closed: ClosedJaxpr, chain: Chain) -> ClosedJaxpr:
    """`closed` whose loss is the unscaled loss: the chain recomputed with its factors set to one
    (the original equations stay for the other outputs that read their values)."""
    eqns = list(closed.jaxpr.eqns)
    value = None
    for k, carried, factor, _ in reversed(chain.path):
        invars = list(eqns[k].invars)
        if value is not None:
            invars[carried] = value
        if factor is not None:
            invars[factor] = _literal_one(invars[factor])
        value = Var(eqns[k].outvars[0].aval)
        eqns.append(eqns[k].replace(invars=invars, outvars=[value]))
    outvars = [value, *closed.jaxpr.outvars[1:]]
    return ClosedJaxpr(closed.jaxpr.replace(eqns=eqns, outvars=outvars), closed.consts)


def _refuse(name: str, what: str) -> MpmdError:
    return MpmdError(
        f"{name}: the loss {what}, so each microbatch's value depends on how the batch is cut and "
        "their mean is not the loss of the whole batch. Pass microbatch_weight_fn=w (w takes the "
        "loss function's arguments and returns the weight of one microbatch, e.g. its count of "
        "real tokens; the step returns sum(w_i * loss_i) / sum(w_i)), end the loss with the "
        "division by the batch's count itself (sum(per_token * mask) / sum(mask)), or, to accept "
        "the plain mean over microbatches, pass microbatch_weight_fn=lambda *args: 1.0."
    )


def loss_weights(
    name: str,
    closed: ClosedJaxpr,
    kinds: dict,
    *,
    reduce: str,
    weight_fn: Callable | None,
    whole: Callable[[], ClosedJaxpr],
    keys: frozenset = frozenset(),
    exact: bool = True,
) -> tuple[ClosedJaxpr, LossWeights]:
    """The loss jaxpr each stage program runs, and how its microbatches combine.

    `kinds`: flat leaf -> `PARAM` / `BATCH` / `OTHER`; `weight_fn`: the user's
    weight, already traced (a closed jaxpr over the same leaves at microbatch
    size); `whole()` traces the loss on the whole batch (called only when the
    loss ends in a chain of batch factors); `exact=False` keeps the declared
    reduction (a `treduce`, whose reference is the loop over microbatches)."""
    if weight_fn is not None:
        return closed, LossWeights(reduce, weight=_weight_program(name, weight_fn, kinds), keys=keys)
    if not exact:
        return closed, LossWeights(reduce)
    chain = loss_chain(closed, kinds)
    odd = _batch_scaled(closed, kinds, {v for k, _, _, _ in chain.path for v in closed.jaxpr.eqns[k].outvars})
    if odd:
        raise _refuse(
            name, f"scales a value by a scalar computed from the batch ({odd[0]}) before its last step"
        )
    if reduce == "sum":
        if chain.batch_scaled:
            raise _refuse(
                name, "ends in a scaling by a value computed from the batch while reduce='sum' adds"
            )
        return closed, LossWeights(reduce)
    if not chain.factors:
        return closed, LossWeights(reduce)
    full = whole()
    full_chain = loss_chain(full, kinds)
    if [d for _, _, d in full_chain.factors] != [d for _, _, d in chain.factors]:
        raise _refuse(name, "ends in different scalings for a microbatch and for the whole batch")
    factors = Subprogram.of(full, full_chain.values(full))
    if any(kinds.get(a) == PARAM for a in factors.reads):
        raise _refuse(name, "ends in a scaling that reads the parameters on the whole batch")
    divides = tuple(d for _, _, d in chain.factors)
    return unscaled(closed, chain), LossWeights(reduce, factors=factors, divides=divides, keys=keys)


def _weight_program(name: str, closed: ClosedJaxpr, kinds: dict) -> Subprogram:
    out = closed.out_avals
    if len(out) != 1 or out[0].shape != () or not jnp.issubdtype(out[0].dtype, jnp.number):
        raise MpmdError(
            f"{name}: microbatch_weight_fn must return one number per microbatch (a scalar), got "
            f"{[a.str_short() for a in out]}."
        )
    program = Subprogram.of(closed, closed.jaxpr.outvars)
    if any(kinds.get(a) == PARAM for a in program.reads):
        raise MpmdError(
            f"{name}: microbatch_weight_fn reads the differentiated parameters; a microbatch's weight "
            "must come from the batch (and other non-differentiated arguments) only, e.g. its count "
            "of real tokens."
        )
    return program


def reading_weights(graph: StageGraph, weights: LossWeights) -> StageGraph:
    """`graph` with the loss stage also reading the leaves its coefficient reads (placed on its
    rank with its other inputs; a batch leaf there is whole, so the coefficient needs no
    transfer)."""
    s = graph.result_stage[0]
    stage = graph.stages[s]
    missing = set(weights.reads) - set(stage.arg_inputs)
    if not missing:
        return graph
    stages = list(graph.stages)
    stages[s] = dataclasses.replace(stage, arg_inputs=tuple(sorted({*stage.arg_inputs, *missing})))
    return dataclasses.replace(graph, stages=tuple(stages))


def microbatched_loss(
    name: str, loss: Callable, args: tuple, kinds: dict, m: int, *, weight_fn=None, keys=frozenset()
):
    """The loss of `args` (flat leaves of kind `kinds`, batch leaves split in `m`, `keys` folded
    per microbatch) as a loop's pieces: `(piece(i, leaves) -> outputs, scaled(i, leaves, loss),
    out_tree)`, microbatch `i`'s outputs (its loss unscaled as the pipeline's stages compute it)
    and that loss weighed, so that `sum_i scaled(i, leaves, piece(i)[0])` is the step's loss (see
    `loss_weights`; `reduce="mean"`). For a loop over microbatches in one program (a step
    without a pipeline axis), so that it equals the pipelined step."""
    leaves, tree = jax.tree.flatten(args)
    box: list = []
    batch = frozenset(a for a, k in kinds.items() if k == BATCH)

    def avals(split: bool) -> list:
        return [
            jax.ShapeDtypeStruct(
                (x.shape[0] // m, *x.shape[1:]) if split and a in batch else x.shape, x.dtype
            )
            for a, x in enumerate(leaves)
        ]

    def flat(*xs):
        out, out_tree = jax.tree.flatten(loss(*jax.tree.unflatten(tree, xs)))
        box.append(out_tree)
        return out

    closed = jax.make_jaxpr(flat)(*avals(True))
    weight = (
        None
        if weight_fn is None
        else jax.make_jaxpr(lambda *xs: weight_fn(*jax.tree.unflatten(tree, xs)))(*avals(True))
    )
    closed, weights = loss_weights(
        name,
        closed,
        kinds,
        reduce="mean",
        weight_fn=weight,
        whole=lambda: jax.make_jaxpr(flat)(*avals(False)),
    )
    whole = Subprogram.of(closed, closed.jaxpr.outvars)

    def piece(i, xs: list) -> list:
        size = {a: xs[a].shape[0] // m for a in batch}
        own = {
            a: jax.lax.dynamic_slice_in_dim(x, i * size[a], size[a]) if a in batch else x
            for a, x in enumerate(xs)
        }
        own.update((a, fold_key(own[a], i)) for a in keys)
        return whole(own)

    def scaled(i, xs: list, loss):
        return weights.scale(loss, weights.coefficient(dict(enumerate(xs)), batch, i, m), m)

    return piece, scaled, box[0]
