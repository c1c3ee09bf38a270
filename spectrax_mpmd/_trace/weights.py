"""How a training step weighs its microbatches' losses, so that it equals the unsplit loss.

Three rules, one per setting:

* **Exact** (the default): the loss is proven affine in sums over the batch's
  rows, with coefficients computed from the batch alone
  (`spectrax_mpmd._trace.exact_loss`); each microbatch emits its partial sums,
  and the loss cell scales them by the coefficients of the whole batch
  (`LossHead`), so the step's loss and gradients are the unsplit ones. A loss
  the proof does not cover is refused, naming the operation.
* **User weights** (`microbatch_weight_fn=w`, `w` with the loss function's
  signature, evaluated on each microbatch's slice of the batch arguments):
  `sum_i w_i * L_i / sum_i w_i`; when every weight is zero, the plain mean.
* **A declared reduction** (`reduce="mean"` or `"sum"`): the mean or the sum of
  the microbatch losses `L_i`, the user's statement that this is what they want.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from ..errors import MpmdError
from .args import fold_key
from .exact_loss import BATCH, PARAM, prove
from .graph import StageGraph
from .jax_private import ClosedJaxpr, Var
from .jaxpr import eval_eqns, needed_eqns, read
from .loss_head import LossHead


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
    """The weight of each microbatch's loss output (see the module docstring)."""

    reduce: str = "mean"
    weight: Subprogram | None = None  # the user's weight of one microbatch
    keys: frozenset = frozenset()  # broadcast leaves folded per microbatch
    head: LossHead | None = None  # the exact rule's head over the packed partial sums
    loss_aval: object = None  # the loss's own aval when the loss output is packed

    @property
    def reads(self) -> tuple[int, ...]:
        """The flat leaves the weighing reads (batch leaves whole, broadcast leaves as given)."""
        parts = (self.head.reads if self.head else (), self.weight.reads if self.weight else ())
        return tuple(sorted({*parts[0], *parts[1]}))

    def weigh(self, loss, leaves: dict, batch, idx, m: int):
        """Microbatch `idx`'s share of the step's loss from its loss output `loss`, the whole-batch
        `leaves` (`batch`: which of them are batch leaves)."""
        if self.head is not None:
            return self.head.share(loss, self.head.coefficients(leaves), idx == 0)
        if self.weight is None:
            return loss / m if self.reduce == "mean" else loss
        weights = self.all_weights(leaves, frozenset(batch), m)
        total = jnp.sum(weights)
        share = jnp.where(total == 0, 1.0 / m, weights[idx] / jnp.where(total == 0, 1.0, total))
        return loss.astype(jnp.promote_types(loss.dtype, jnp.float32)) * share

    def scaler(self, io, X: list, Bf: list, idx, m: int) -> Callable:
        """`loss output -> its share` inside a loss stage's cell (`io`: its `StageIO`; `X`, `Bf`: its
        broadcast and whole batch leaves; `idx`: the microbatch)."""
        leaves = dict(zip(io.batch, Bf)) | dict(zip(io.fixed, X))
        return lambda loss: self.weigh(loss, leaves, io.batch, idx, m)

    def all_weights(self, leaves: dict, batch: frozenset, m: int):
        """The user's weight of every microbatch, float32 `[m]`."""

        def one(j, sliced):
            own = dict(leaves) | sliced
            own.update((a, fold_key(leaves[a], j)) for a in self.keys if a in own)
            return jnp.asarray(self.weight(own)[0], jnp.float32)

        split = {a: leaves[a].reshape(m, -1, *leaves[a].shape[1:]) for a in self.weight.reads if a in batch}
        return jax.vmap(one)(jnp.arange(m), split)


def loss_weights(
    name: str,
    closed: ClosedJaxpr,
    kinds: dict,
    *,
    reduce: str | None,
    weight_fn: ClosedJaxpr | None,
    whole: Callable[[], ClosedJaxpr],
    m: int,
    keys: frozenset = frozenset(),
    exact: bool = True,
) -> tuple[ClosedJaxpr, LossWeights]:
    """The loss jaxpr each stage program runs, and how its microbatches combine.

    `kinds`: flat leaf -> `PARAM` / `BATCH` / `OTHER`; `weight_fn`: the user's
    weight, already traced (a closed jaxpr over the same leaves at microbatch
    size); `whole()` traces the loss on the whole batch; `exact=False` keeps the
    declared reduction (a `treduce`, whose reference is the loop over
    microbatches). Without `weight_fn` or an explicit `reduce`, the loss is proven
    exact (`spectrax_mpmd._trace.exact_loss`) or refused."""
    if weight_fn is not None:
        return closed, LossWeights("mean", weight=_weight_program(name, weight_fn, kinds), keys=keys)
    if reduce is not None or not exact:
        return closed, LossWeights(reduce or "mean")
    if m == 1:
        return closed, LossWeights("sum")
    body, head = prove(name, closed, whole(), kinds, m, keys)
    return body, LossWeights(head=head, loss_aval=closed.out_avals[0])


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
    """`graph` with the loss stage also reading the leaves its weighing reads (placed on its rank
    with its other inputs; a batch leaf there is whole, so the coefficients need no transfer), and
    the loss's own aval as the first output's when the stages emit packed partial sums."""
    if weights.loss_aval is not None:
        graph = dataclasses.replace(graph, out_avals=(weights.loss_aval, *graph.out_avals[1:]))
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
    out_tree)`, microbatch `i`'s outputs (its loss output as the pipeline's stages compute it)
    and its share of the step's loss, so that `sum_i scaled(i, leaves, piece(i)[0])` is the
    step's loss (see `loss_weights`). For a loop over microbatches in one program (a step
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
        reduce=None,
        weight_fn=weight,
        whole=lambda: jax.make_jaxpr(flat)(*avals(False)),
        m=m,
        keys=keys,
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
        return weights.weigh(loss, dict(enumerate(xs)), batch, i, m)

    return piece, scaled, box[0]
