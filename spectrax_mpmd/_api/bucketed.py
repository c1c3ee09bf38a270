"""A training step with `LengthBuckets`: each call's batch cut into microbatches at their own
length, each bucket's loss traced and split on its own, one plan running them all
(`spectrax_mpmd._plan.buckets`).

The loss is proven exact on the padded batch as any step's (`spectrax_mpmd._trace.exact_loss`):
its coefficients (a token count) are computed by the loss cells from the padded batch leaves they
read, and each bucket's stages emit the partial sums of their microbatch, proven the same way at
the bucket's length. A bucket whose partial sums differ in shape from the padded batch's (a sum
per position) is refused.

A whole training step (`sxvalue_and_grad_and_apply`, a runner's `update`) cuts its call through
the step it calls (`refine_around`) and builds the same plan with its update appended
(`bucketed_plan` with an `Epilogue`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from .._buckets import MicrobatchRows, in_order, key_path, split_rows
from .._comm import is_transfer
from .._plan import Epilogue, PlanArgs
from .._plan.buckets import build_bucketed_train_plan
from .._runtime import Output, Plan
from .._trace.args import ArgumentKinds, Signature, classify, positional_names, signature, traced_avals
from .._trace.exact_loss import BATCH, PARAM
from .._trace.policy import stage_policies
from .._trace.split import split, trace
from .._trace.weights import loss_weights, reading_weights
from ..errors import MpmdError
from .entry import Entry, build_plan
from .param_specs import specs_of
from .weighing import check_loss, step_weights, with_aux
from .whole_batch import WholeBatchTrace


@dataclasses.dataclass(frozen=True)
class BucketSignature(Signature):
    """A call's signature with its microbatches' rows and lengths: its leaves are the call's,
    then each microbatch's batch leaves (cut to its rows and length), `stride` per microbatch."""

    base: Signature | None = None
    rows: MicrobatchRows | None = None
    kinds: ArgumentKinds | None = None
    sequence: frozenset = frozenset()  # the batch leaves cut along the sequence axis
    inner: BucketSignature | None = None  # a whole training step's: that of the step it calls


@dataclasses.dataclass(frozen=True)
class InnerStep:
    """The pipelined step with `LengthBuckets` a whole training step (`sxvalue_and_grad_and_apply`)
    calls, and how: `select(arguments)` are the step's arguments among the function's."""

    step: object
    select: Callable


def _sequence_leaves(step, sig: Signature, kinds: ArgumentKinds) -> tuple[frozenset, int]:
    axis = step.settings.length_buckets.axis
    long = [a for a in kinds.batch if len(sig.types[a][0]) > axis]
    if not long:
        raise MpmdError(
            f"{step.name}: length_buckets cuts the batch along axis {axis}, but no batch leaf has that "
            "axis; pass the padded sequences as batch arguments (or set LengthBuckets(axis=...))."
        )
    padded = max(sig.types[a][0][axis] for a in long)
    return frozenset(a for a in long if sig.types[a][0][axis] == padded), padded


def _lengths_leaf(step, sig: Signature, kinds: ArgumentKinds) -> int:
    buckets = step.settings.length_buckets
    where = buckets.path(step.name, positional_names(step.fn))
    flat = jax.tree_util.tree_flatten_with_path(sig.in_tree.unflatten(range(sig.in_tree.num_leaves)))[0]
    leaves = {(sig.positions[p[0].idx], *key_path(p[1:])): a for p, a in flat}
    a = leaves.get(where)
    if a is None or a not in kinds.batch:
        raise MpmdError(
            f"{step.name}: LengthBuckets(lengths={buckets.lengths!r}) must say where a batch leaf holding "
            "one integer array [rows] of row lengths is: an argument's position or name, or a path "
            "(argument, key, ...) to a leaf inside it."
        )
    return a


def _cut(leaf, rows, axis: int, length: int | None):
    """`leaf`'s `rows`, cut to `length` along `axis` where given; a `jax.ShapeDtypeStruct` (a
    `prepare` without values) gives the one of that shape."""
    if not hasattr(leaf, "__array__"):
        shape = list(leaf.shape)
        shape[0] = len(rows)
        if length is not None:
            shape[axis] = length
        return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype, sharding=getattr(leaf, "sharding", None))
    x = np.take(np.asarray(leaf), rows, axis=0)
    return x if length is None else x[(slice(None),) * axis + (slice(0, length),)]


def refine(step, sig: Signature) -> BucketSignature:
    """`sig` with this call's microbatches: which rows each holds and its bucket length."""
    settings = step.settings
    m = settings.schedule.microbatches
    kinds = classify(step.name, step.fn, sig, settings.positions, settings.batch_argnums, m)
    sequence, padded = _sequence_leaves(step, sig, kinds)
    lengths = sig.leaves[_lengths_leaf(step, sig, kinds)]
    rows = split_rows(settings.length_buckets, lengths, padded, m, step.name)
    rows = in_order(settings.length_buckets, rows, settings.schedule, step.mesh.mpmd_dim)
    axis = settings.length_buckets.axis
    extra, types = [], []
    for r, length in zip(rows.rows, rows.lengths):
        for a in kinds.batch:
            x = _cut(sig.leaves[a], r, axis, length if a in sequence else None)
            extra.append(x)
            types.append((x.shape, *sig.types[a][1:]))
    return BucketSignature(
        (sig.key, rows.lengths),
        sig.statics,
        sig.positions,
        [*sig.leaves, *extra],
        sig.in_tree,
        (*sig.types, *types),
        base=sig,
        rows=rows,
        kinds=kinds,
        sequence=sequence,
    )


def refine_around(inner: InnerStep, sig: Signature) -> BucketSignature:
    """A whole training step's signature with the microbatches of the step it calls: that step's
    `BucketSignature` (`inner`), whose microbatches' leaves are appended to the function's."""
    step = inner.step
    own = refine(step, signature(step.name, step.fn, inner.select(sig.arguments()), step.static_argnums))
    n = len(own.base.leaves)
    return BucketSignature(
        (sig.key, own.rows.lengths),
        sig.statics,
        sig.positions,
        [*sig.leaves, *own.leaves[n:]],
        sig.in_tree,
        (*sig.types, *own.types[n:]),
        base=sig,
        rows=own.rows,
        inner=own,
    )


def _padded_weights(step, sig: BucketSignature):
    """How the microbatches weigh (`LossWeights`) for the padded batch: its exact loss's
    coefficients, from the padded batch's leaves."""
    base, kinds, m = sig.base, sig.kinds, len(sig.rows.lengths)
    fn = with_aux(base.bind(step.fn), False)
    whole = WholeBatchTrace(fn, base, step.compiler.stats)
    micro = traced_avals(base, kinds, m)
    with step.compiler.stats.timed("trace"):
        closed, _, out_tree, regions = trace(fn, base.in_tree.unflatten(micro))
    if regions:
        raise MpmdError(f"{step.name}: length_buckets runs one schedule; the function opens sxstage_regions.")
    check_loss(step.name, closed)
    with step.compiler.stats.timed("analysis"):
        _, weights = step_weights(step, base, kinds, micro, closed, lambda: whole.closed, m)
    return weights, out_tree


def _bucket_graph(step, sig: BucketSignature, length: int, weights):
    """`(StageGraph, PlanArgs)` of the microbatches at `length`: the loss traced with the batch
    leaves replaced by templates (leaves numbered after the call's) at that length."""
    base, kinds, m = sig.base, sig.kinds, len(sig.rows.lengths)
    n, axis, fn = len(base.leaves), step.settings.length_buckets.axis, with_aux(base.bind(step.fn), False)
    whole_avals = [base.aval(a) for a in range(n)]

    def templates(rows: int) -> list:
        out = []
        for a in kinds.batch:
            shape = list(base.types[a][0])
            shape[0] = rows
            if a in sig.sequence:
                shape[axis] = length
            out.append(base.aval(a, tuple(shape)))
        return out

    def bucket_loss(leaves, batch):
        leaves = list(leaves)
        for a, x in zip(kinds.batch, batch):
            leaves[a] = x
        return fn(*base.in_tree.unflatten(leaves))

    mb = kinds.batch_size // m
    with step.compiler.stats.timed("trace"):
        closed = trace(bucket_loss, (whole_avals, templates(mb)))[0]
    roles = {a: PARAM for a in kinds.params} | {n + k: BATCH for k in range(len(kinds.batch))}
    with step.compiler.stats.timed("analysis"):
        body, own = loss_weights(
            step.name,
            closed,
            roles,
            reduce=step.settings.reduce,
            weight_fn=None,
            whole=lambda: trace(bucket_loss, (whole_avals, templates(kinds.batch_size)))[0],
            m=m,
            keys=kinds.keys,
            exact=step.exact,
        )
    _check_same_sums(step.name, own, weights, length)
    with step.compiler.stats.timed("split"):
        graph = reading_weights(split(body, step.n_stages), weights)
    batch = tuple(range(n, n + len(kinds.batch)))
    settings = step.settings
    args = PlanArgs(
        params=tuple(kinds.params),
        batch=batch,
        batch_avals=dict(zip(batch, templates(mb))),
        keys=kinds.keys,
        param_specs=specs_of(step, base, kinds),
        weights=weights,
        **stage_policies(settings.remat, settings.offload, len(graph.stages)),
    )
    return graph, args


def _check_same_sums(name: str, own, padded, length: int) -> None:
    """Refuse a bucket whose packed partial sums differ from the padded batch's."""
    if own.head is None or padded.head is None:
        return

    def shapes(head):
        return [(v.aval.shape, v.aval.dtype) for v in (*head.sources, *head.terms)]

    if shapes(own.head) != shapes(padded.head):
        raise MpmdError(
            f"{name}: at length {length} the loss sums the rows into values of shapes "
            f"{shapes(own.head)}, on the padded batch {shapes(padded.head)}; length_buckets needs sums "
            "that do not depend on the sequence length (sum over the positions too)."
        )


def bucketed_plan(step, sig: BucketSignature, epilogue: Epilogue | None = None) -> Plan:
    """The compiled plan of a call of `step` with these microbatches, then `epilogue` (a whole
    training step's update) if given."""
    traced = step.buckets_traced  # per call signature: the padded batch's weights, each bucket's graph
    key = sig.base.key
    if key not in traced:
        traced[key] = (*_padded_weights(step, sig), {})
    weights, _, graphs = traced[key]
    for length in sig.rows.buckets:
        if length not in graphs:
            graphs[length] = _bucket_graph(step, sig, length, weights)
    buckets = {length: graphs[length] for length in sig.rows.buckets}
    n, settings = len(sig.base.leaves), step.settings
    return build_plan(
        step.compiler,
        build_bucketed_train_plan,
        buckets,
        sig.rows.lengths,
        n,
        settings.schedule,
        step.mesh,
        epilogue,
    )


def bucketed_entry(step, sig: BucketSignature) -> Entry:
    """The compiled plan of a call with these microbatches, with its output trees."""
    plan = bucketed_plan(step, sig)
    out_tree, lengths = step.buckets_traced[sig.base.key][1], sig.rows.lengths
    slots = plan.output_slots[Output.GRADS]
    ranges = dict(zip(sig.positions, sig.base.ranges()))
    grad_trees = tuple(
        (sig.in_tree.children()[sig.positions.index(k)], [slots[a] for a in ranges[k]])
        for k in sig.kinds.argnums
    )
    return Entry(plan, out_tree, grad_trees=grad_trees, lengths=lengths)


@dataclasses.dataclass(frozen=True)
class BucketSummary:
    """A call's microbatches and what its plan runs: each microbatch's length in schedule order,
    the buckets, and the distinct programs of the plan (cells of every (stage, kind, bucket),
    the accumulators' and the gradient reduction's), of which the build compiled and relocated
    how many (a program the compiler held already, from an earlier composition of buckets,
    is neither)."""

    lengths: tuple[int, ...]
    programs: int
    compiled: int
    relocated: int

    @property
    def buckets(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.lengths), reverse=True))

    def __str__(self) -> str:
        counts = ", ".join(f"{b} x{self.lengths.count(b)}" for b in self.buckets)
        return (
            f"{len(self.lengths)} microbatches in {len(self.buckets)} buckets (length x microbatches: "
            f"{counts}); first: {self.lengths[0]}; {self.programs} programs "
            f"({self.compiled} compiled, {self.relocated} relocated)"
        )


def bucket_summary(step, args) -> BucketSummary:
    """The `BucketSummary` of `step`'s plan for these arguments (built if needed)."""
    entry, _ = step._entry(args)
    lengths = entry.lengths
    programs = len({id(st.fn) for st in entry.plan.steps if not is_transfer(st.fn)})
    return BucketSummary(lengths, programs, entry.build.get("compiled", 0), entry.build.get("relocated", 0))
