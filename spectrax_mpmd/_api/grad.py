"""`sxvalue_and_grad` and `sxgrad`: the pipelined training step, and its measurements."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, NamedTuple, Sequence

import jax

from spectrax_core.schedules import Schedule, Timeline

from .._compile.compiler import Compiler
from .._plan import PlanArgs, build_train_plan
from .._runtime import (
    HostProfile,
    Output,
    Plan,
    StageProfile,
    action_spans,
    measure_peak_bytes,
    measure_peak_bytes_by_kind,
    measured_timeline,
    peak_activations,
    stage_profile,
)
from .._settings import StepSettings
from .._trace.args import Signature, classify, traced_avals
from .._trace.context import methods_outside_context_mesh
from .._trace.graph import StageGraph
from .._trace.pipelined import inside_train_step
from .._trace.policy import stage_policies
from .._trace.split import split, trace
from .._trace.weights import reading_weights
from ..errors import MpmdError
from .agree import InputsCheck
from .bind import bind_pipeline
from .bucketed import BucketSignature, BucketSummary, bucket_summary, bucketed_entry, refine
from .checks import microbatches, pipeline_schedule
from .entry import Entry, Placer, build_plan, build_timings, cached_entry, host_cost, prepare
from .param_specs import specs_of
from .weighing import check_loss, step_weights, with_aux
from .whole_batch import WholeBatchTrace


class Pipeline(NamedTuple):
    """A loss traced and split for one signature, with what its plan needs."""

    graph: StageGraph
    schedule: Schedule
    args: PlanArgs
    argnums: tuple  # the differentiated positions
    ranges: dict  # position -> its flat leaf indices
    out_tree: object  # of (loss, aux)


@methods_outside_context_mesh
class _StepFunction:
    """The callable returned by `sxvalue_and_grad` / `sxgrad`: `fn` run as `settings` say."""

    def __init__(
        self,
        fn,
        settings: StepSettings,
        *,
        value=True,
        exact=True,
        fold_keys=True,
        compiler: Compiler | None = None,
    ):
        self.fn, self.settings, self.value, self.exact = fn, settings, value, exact
        self.mesh = settings.pipeline_mesh
        self.schedule_error = settings.schedule_error()
        if self.schedule_error is None:
            stage_policies(settings.remat, settings.offload, self.n_stages)  # per-stage values fit
        self.fold_keys = fold_keys  # broadcast PRNG keys folded per microbatch
        self.compiler = compiler if compiler is not None else Compiler()
        self.placer = Placer()
        self.inputs_check = InputsCheck(self.name, fn, self.mesh)
        self.cache: dict = {}
        self.buckets_traced: dict = {}  # with length_buckets: what every composition of buckets shares
        functools.update_wrapper(self, fn)

    # the settings other parts read (each is `self.settings`'s; `schedule` is None where the
    # function's regions name theirs, `given_argnums` is `argnums` as written: an int gives one tree)
    name = property(lambda self: self.settings.name)
    static_argnums = property(lambda self: self.settings.static_argnums)
    has_aux = property(lambda self: self.settings.has_aux)
    schedule = property(lambda self: self.settings.schedule)
    given_argnums = property(lambda self: self.settings.argnums)
    n_stages = property(lambda self: self.settings.model_stages())

    def pipeline(self, sig: Signature) -> Pipeline:
        """Trace and split the loss for this signature: what a plan of it is built from."""
        settings = self.settings
        whole = WholeBatchTrace(with_aux(sig.bind(self.fn), self.has_aux), sig, self.compiler.stats)
        m = microbatches(settings, lambda: whole.regions)
        kinds = classify(self.name, self.fn, sig, settings.positions, settings.batch_argnums, m)
        if not self.fold_keys:
            kinds = dataclasses.replace(kinds, keys=frozenset())
        micro = traced_avals(sig, kinds, m)
        with self.compiler.stats.timed("trace"):
            closed, _, out_tree, regions = trace(
                with_aux(sig.bind(self.fn), self.has_aux), sig.in_tree.unflatten(micro)
            )
        check_loss(self.name, closed)
        pipeline_schedule(settings, self.schedule_error, None, regions)
        with self.compiler.stats.timed("analysis"):
            closed, weights = step_weights(self, sig, kinds, micro, closed, lambda: whole.closed, m)
        with self.compiler.stats.timed("split"):
            graph = reading_weights(split(closed, self.n_stages), weights)
        schedule = pipeline_schedule(settings, self.schedule_error, graph, regions)
        ranges = dict(zip(sig.positions, sig.ranges()))
        args = PlanArgs(
            params=tuple(kinds.params),
            batch=tuple(kinds.batch),
            batch_avals={a: sig.aval(a) for a in kinds.batch},
            keys=kinds.keys,
            param_specs=specs_of(self, sig, kinds),
            weights=weights,
            **stage_policies(settings.remat, settings.offload, len(graph.stages)),
        )
        self.last_graph = graph
        return Pipeline(graph, schedule, args, kinds.argnums, ranges, out_tree)

    def build_entry(self, sig: Signature) -> Entry:
        if isinstance(sig, BucketSignature):
            return bucketed_entry(self, sig)
        pipe = self.pipeline(sig)
        plan = build_plan(self.compiler, build_train_plan, pipe.graph, pipe.schedule, self.mesh, pipe.args)
        slots = plan.output_slots[Output.GRADS]
        grad_trees = tuple(
            (sig.in_tree.children()[sig.positions.index(k)], [slots[a] for a in pipe.ranges[k]])
            for k in pipe.argnums
        )
        return Entry(plan, pipe.out_tree, grad_trees=grad_trees)

    def _entry(self, args):
        return cached_entry(self, args)

    def refine_signature(self, sig: Signature) -> Signature:
        """With `length_buckets`, the call's signature with its microbatches' lengths and leaves
        (`BucketSignature`): the plan depends on them."""
        return sig if self.settings.length_buckets is None else refine(self, sig)

    def measure_peak_activations(self, *args) -> list[int]:
        """Run one step and return, per rank, the most `(stage, microbatch)` activations alive at once."""
        entry, leaves = self._entry(args)
        return peak_activations(entry.plan, entry.place(self.placer, leaves))

    def measure_peak_bytes(self, *args) -> tuple[int, ...]:
        """Run one step and return, per rank, the most device bytes alive on its devices between actions
        (its most loaded device: parameters, batch, accumulators and every activation, residual,
        stash and cotangent in flight; temporaries inside a cell are not counted). The step's
        results are discarded."""
        entry, leaves = self._entry(args)
        return measure_peak_bytes(entry.plan, entry.place(self.placer, leaves))

    def measure_peak_bytes_by_kind(self, *args) -> dict[str, tuple[int, ...]]:
        """`measure_peak_bytes` per memory kind: `{"device": per rank, "host": per rank}`."""
        entry, leaves = self._entry(args)
        return measure_peak_bytes_by_kind(entry.plan, entry.place(self.placer, leaves))

    def measure_timeline(self, *args, clock: str = "wall") -> Timeline:
        """Run one step cell by cell, timing each, as a `spectrax_core.schedules.Timeline` in µs.

        Each action is one event on its rank (its cell plus the sends after it);
        `spectrax_core.schedules.chrome_trace(timeline, us_per_unit=1)` turns it
        into a Chrome trace (one track per rank, slices named as they ran: `2F5`, the loss stage's
        fused cell `3FB5`).
        `clock="cpu"` times with this process's CPU time instead of the wall clock
        (the cells run one at a time, so each event is what its cell computed,
        without the waits other processes' load adds).
        """
        entry, leaves = self._entry(args)
        schedule, n = entry.plan.schedule, self.mesh.mpmd_dim
        spans = action_spans(entry.plan, entry.place(self.placer, leaves), clock)
        return measured_timeline(spans, n, repr(schedule), schedule.stage_labels(n))

    def profile(self, *args, rounds: int = 7) -> HostProfile:
        """Host cost of one step on these arguments: issue CPU time per rank and cell kind, call
        and transfer counts, and the share of the step spent issuing (`HostProfile`; print
        `.table()`). Runs the step `2 * rounds` times."""
        return host_cost(self, args, rounds)

    def profile_stages(self, *args, rounds: int = 3, clock: str = "wall") -> StageProfile:
        """Per stage and cell kind, for these arguments: XLA's cost and memory analysis of the
        compiled cells, what each forward saves (and each I cell stashes) per microbatch, each
        rank's parameter and accumulator bytes, bytes per edge, the bytes each stage and rank
        holds (`.stage_memory()`), and each cell's measured time (`StageProfile`; print
        `.table()`). Runs the step `rounds` times cell by cell (timed on `clock`, as
        `measure_timeline`), and once more to size its buffers."""
        entry, leaves = self._entry(args)
        entry.plan.check_single_process(f"{self.name}.profile_stages")
        try:
            return stage_profile(
                entry.plan,
                self.compiler.compile_spec,
                dict(enumerate(leaves)),
                entry.place(self.placer, leaves),
                rounds,
                clock,
            )
        finally:
            self.compiler.forget_lowerings()

    def timings(self, *args) -> dict:
        """Where the first call's time went, for these arguments' signature (default: the last
        call's): seconds per phase (trace, split, lower, compile, relocate, plan, first_run;
        see `BuildStats`), their total, and how many programs were compiled and relocated."""
        return build_timings(self, args)

    def bucket_summary(self, *args) -> BucketSummary:
        """With `length_buckets`: these arguments' microbatch lengths, buckets and the plan's
        program count (`BucketSummary`; print it)."""
        if self.settings.length_buckets is None:
            raise MpmdError(f"{self.name}: bucket_summary describes a step with length_buckets=.")
        return bucket_summary(self, args)

    def prepare(self, *args) -> dict:
        """Everything the first call with these arguments' signature does before it runs, now:
        trace and split, compile every rank's programs (distinct ones concurrently, identical
        ones once), in a multi-process job check that every process built the same step
        (refused naming the first field that differs) and open the transfer channels in one
        order. `args` are arrays or `jax.ShapeDtypeStruct`s, as a call takes them; the call
        itself then only runs. Returns the build report (`timings`). Like
        `jax.jit(f).lower(*args).compile()`, but the compiled step stays in this step's cache."""
        return prepare(self, args)

    def plan_for(self, *args) -> Plan:
        """The compiled plan (stage graph cells, dispatch order) for these arguments' signature."""
        return self._entry(args)[0].plan

    def __call__(self, *args):
        if inside_train_step() and any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return bind_pipeline(self, args)
        entry, leaves = self._entry(args)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        out = entry.plan.output_slots
        trees = [treedef.unflatten([buf[s] for s in slots]) for treedef, slots in entry.grad_trees]
        aux_leaves = [buf[out[Output.AUX][j]] for j in sorted(out[Output.AUX])]
        return self.result(entry.out_tree, buf[out[Output.LOSS]], aux_leaves, trees)

    def result(self, out_tree, loss, aux_leaves: list, trees: list):
        """What a call returns, from the loss, the stacked aux leaves and one gradient tree per
        differentiated argument: `(value, grads)`, or for `sxgrad` the gradients (and aux)."""
        grads = trees[0] if len(trees) == 1 else tuple(trees)
        value = jax.tree.unflatten(out_tree, [loss, *aux_leaves]) if self.has_aux else loss
        if self.value:
            return value, grads
        return (grads, value[1]) if self.has_aux else grads

    @property
    def dispatch_log(self) -> list:
        """`(rank, action, cell)` for every action issued by the last call, in issue order."""
        return list(self.last_plan.log)


def sxvalue_and_grad(
    fn: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    mesh,
    schedule: Schedule | None = None,
    has_aux: bool = False,
    remat=False,
    offload=False,
    rules=None,
    batch_argnums: int | Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
    reduce: str | None = None,
    region_ranks: dict | None = None,
    microbatch_weight_fn: Callable | None = None,
    length_buckets=None,
) -> Callable:
    """Pipelined `jax.value_and_grad`: `step(params, batch, ...) -> (loss, grads)`.

    Arguments are of four kinds. `argnums` are the parameters (differentiated,
    never split). `batch_argnums` (default: every other non-static argument)
    are split on their shared leading axis into `schedule.microbatches`. Every
    other non-static argument is broadcast: the same value reaches every
    microbatch, and a PRNG key among them reaches microbatch `i` as
    `jax.random.fold_in(key, i)`. `static_argnums` are hashed into the cache key
    and bound into the trace, as in `jax.jit`.

    The loss is the loss of the whole batch and the gradients are its exact
    gradients, each leaf on the submesh of the rank that owns it (the first
    stage that reads it). The step proves this from the traced function (the
    loss is a combination of sums over the batch with coefficients computed
    from the batch alone: `jnp.mean`, a padded token mean, sums of such terms,
    regularisers) or refuses the loss before any device work, naming the
    operation that stops the proof. `reduce="mean"` (or `"sum"`) declares the
    mean (or sum) of the microbatch losses instead. `microbatch_weight_fn=w`
    (`w` with `fn`'s signature, returning a scalar from each microbatch's slice
    of the batch arguments) makes the loss `sum(w_i * loss_i) / sum(w_i)`,
    gradients alike (see `docs/reference.md`, "Which losses are exact").
    `remat=True` recomputes each stage's forward in its backward instead of
    keeping residuals; a `jax.checkpoint_policies` name (`"dots_saveable"`)
    keeps what that policy saves; a sequence (one per model stage) or mapping
    (`{stage: value}`) sets it per stage. `offload` keeps saved residuals and
    the I->W stash in host memory between their cell and their reader (`True`,
    a share of the bytes, `"residuals"`, `"stash"`, an `mp.Offload`, or per
    stage like `remat`; see `docs/planner.md`). `rules` (a `spectrax_core.sharding` rules object) shards
    each stage's parameters over its submesh; default replicated.

    A function with `sxstage_region`s runs each region's stages on its own ranks
    with its own schedule (`schedule` is the default region's: the code outside
    every region; it may be omitted when there is none and every region names
    its schedule, all with the same microbatches); `region_ranks`
    (`{region name: (rank, ...)}`, `"default"` for the code outside regions)
    places them, by default on consecutive ranks of their own.

    `length_buckets=LengthBuckets(lengths=k)` takes a batch whose rows have their own lengths
    (argument `k`): each call's rows are sorted by length and each microbatch runs padded only
    to its length bucket, one program per (stage, cell kind, bucket), all in one pipelined step
    (see `docs/variable-length.md`).
    """
    return _StepFunction(fn, StepSettings.of("sxvalue_and_grad", locals()), value=True)


def sxgrad(fn: Callable, argnums: int | Sequence[int] = 0, **settings) -> Callable:
    """Pipelined `jax.grad`: like `sxvalue_and_grad` (the same keywords) but returns the gradients
    only (and aux)."""
    try:
        given = sxgrad.__signature__.bind(fn, argnums, **settings)
    except TypeError as e:
        raise TypeError(f"sxgrad(): {e}") from None
    given.apply_defaults()
    return _StepFunction(fn, StepSettings.of("sxgrad", given.arguments), value=False)


sxgrad.__signature__ = inspect.signature(sxvalue_and_grad)


def step_function(fn: Callable, settings: StepSettings, *, compiler: Compiler, **options) -> Callable:
    """The `sxvalue_and_grad` step of `fn` with `settings`, compiling through `compiler`, which
    several steps may share: a program two of them have in common compiles once (the planner
    profiles many). `options` are `_StepFunction`'s (`exact`, `fold_keys`)."""
    return _StepFunction(fn, settings, compiler=compiler, **options)


def profile_stages(
    fn: Callable, *args, mesh, schedule, rounds: int = 3, clock: str = "wall", **step_kwargs
) -> StageProfile:
    """`sxvalue_and_grad(fn, mesh=, schedule=, **step_kwargs).profile_stages(*args)`: the
    per-stage profile of `fn`'s pipelined training step on these arguments."""
    step = sxvalue_and_grad(fn, mesh=mesh, schedule=schedule, **step_kwargs)
    return step.profile_stages(*args, rounds=rounds, clock=clock)
