"""`sxjit`: a function's forward, one program per pipeline stage."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax

from spectrax_core.schedules import Schedule, Timeline

from .._compile.compiler import Compiler
from .._plan import PlanArgs, build_forward_plan
from .._runtime import (
    HostProfile,
    Output,
    action_spans,
    measure_peak_bytes,
    measure_peak_bytes_by_kind,
    measured_timeline,
)
from .._settings import StepSettings
from .._trace.args import Signature, as_tuple, classify, traced_avals
from .._trace.context import methods_outside_context_mesh
from .._trace.pipelined import find_pipeline_call, tracing_train_step
from .._trace.split import split, trace
from .agree import InputsCheck
from .bucketed import BucketSignature, InnerStep, refine_around
from .checks import microbatches, pipeline_schedule
from .entry import Entry, Placer, build_plan, build_timings, cached_entry, fresh_inputs, host_cost, prepare
from .train_step import build_train_step
from .whole_batch import WholeBatchTrace


@methods_outside_context_mesh
class _JitFunction:
    """The callable returned by `sxjit`: runs `fn`'s stages, each on its own rank."""

    def __init__(self, fn, settings: StepSettings, donate_argnums: tuple[int, ...]):
        self.fn, self.settings, self.name = fn, settings, settings.name
        self.mesh, self.static_argnums = settings.pipeline_mesh, settings.static_argnums
        self.schedule_error = settings.schedule_error()
        self.donate_argnums = donate_argnums
        self.compiler, self.placer, self.cache = Compiler(), Placer(), {}
        self.inputs_check = InputsCheck(self.name, fn, self.mesh)
        self.inner_step: InnerStep | None = None  # a whole training step's bucketed pipelined step
        functools.update_wrapper(self, fn)

    def refine_signature(self, sig: Signature) -> Signature:
        """With a bucketed `inner_step`, the call's signature with its microbatches (see
        `_StepFunction.refine_signature`)."""
        return sig if self.inner_step is None else refine_around(self.inner_step, sig)

    def build_entry(self, sig: Signature) -> Entry:
        bucketed, sig = sig, sig.base if isinstance(sig, BucketSignature) else sig  # traced padded
        settings, kinds, split_batch, m = self.settings, None, {}, 1
        if settings.microbatched:  # the batch splits as the schedule says
            whole = WholeBatchTrace(sig.bind(self.fn), sig, self.compiler.stats)
            m = microbatches(settings, lambda: whole.regions)
            kinds = classify("sxjit", self.fn, sig, (), settings.batch_argnums, m)
            split_batch = dict(
                batch=tuple(kinds.batch), batch_avals={a: sig.aval(a) for a in kinds.batch}, keys=kinds.keys
            )
        avals = traced_avals(sig, kinds, m)
        with self.compiler.stats.timed("trace"), tracing_train_step(self):
            closed, _, out_tree, regions = trace(sig.bind(self.fn), sig.in_tree.unflatten(avals))
        donated = self._donated(sig)
        found = find_pipeline_call(closed, self.name)
        if found is not None:
            return build_train_step(self, bucketed, found, out_tree, donated)
        pipeline_schedule(settings, self.schedule_error, None, regions)
        v = 1 if settings.schedule is None else settings.schedule.virtual_stages
        with self.compiler.stats.timed("split"):
            graph = split(closed, self.mesh.mpmd_dim * v)
        schedule = pipeline_schedule(settings, self.schedule_error, graph, regions)
        args = PlanArgs(donated=donated, **split_batch)
        self.last_graph = graph
        plan = build_plan(self.compiler, build_forward_plan, graph, schedule, self.mesh, args)
        return Entry(plan, out_tree, donated=donated)

    def _donated(self, sig: Signature) -> frozenset:
        """The flat leaves of the `donate_argnums` arguments."""
        n_args = len(sig.positions) + len(sig.statics)
        donate = {k % n_args for k in self.donate_argnums if -n_args <= k < n_args}
        return frozenset(
            a
            for position, leaf_range in zip(sig.positions, sig.ranges())
            if position in donate
            for a in leaf_range
        )

    def __call__(self, *args):
        entry, leaves = cached_entry(self, args)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        return jax.tree.unflatten(entry.out_tree, [buf[s] for s in entry.plan.output_slots[Output.RESULTS]])

    def profile(self, *args, rounds: int = 7) -> HostProfile:
        """Host cost of one call (see `sxvalue_and_grad(...).profile`)."""
        return host_cost(self, args, rounds)

    def measure_timeline(self, *args, clock: str = "wall") -> Timeline:
        """Run one call cell by cell, timing each schedule action on `clock` (see
        `sxvalue_and_grad(...).measure_timeline`); donated arguments are copied first, not consumed."""
        entry, leaves = cached_entry(self, args)
        entry.plan.check_single_process(f"{self.name}.measure_timeline")
        plan, n = entry.plan, self.mesh.mpmd_dim
        spans = action_spans(plan, fresh_inputs(entry, self.placer, leaves)(), clock)
        return measured_timeline(spans, n, repr(plan.schedule), plan.schedule.stage_labels(n))

    def measure_peak_bytes(self, *args) -> tuple[int, ...]:
        """Run one call and return, per rank, the most bytes alive on its devices between actions
        and between the steps after the schedule (a training step's update: its parameters,
        optimizer state, gradients and what the update makes); donated arguments are copied
        first, not consumed. See `sxvalue_and_grad(...).measure_peak_bytes`."""
        entry, leaves = cached_entry(self, args)
        entry.plan.check_single_process(f"{self.name}.measure_peak_bytes")
        return measure_peak_bytes(entry.plan, fresh_inputs(entry, self.placer, leaves)())

    def measure_peak_bytes_by_kind(self, *args) -> dict[str, tuple[int, ...]]:
        """`measure_peak_bytes` per memory kind: `{"device": per rank, "host": per rank}` (offloaded
        residuals and stashes are host bytes), as on `sxvalue_and_grad` steps."""
        entry, leaves = cached_entry(self, args)
        entry.plan.check_single_process(f"{self.name}.measure_peak_bytes_by_kind")
        return measure_peak_bytes_by_kind(entry.plan, fresh_inputs(entry, self.placer, leaves)())

    def prepare(self, *args) -> dict:
        """Everything the first call with these arguments' signature does before it runs, now
        (see `sxvalue_and_grad(...).prepare`); returns the build report."""
        return prepare(self, args)

    def timings(self, *args) -> dict:
        """Where the first call's time went (see `sxvalue_and_grad(...).timings`)."""
        return build_timings(self, args)

    @property
    def dispatch_log(self) -> list:
        return list(self.last_plan.log)


def sxjit(
    fn: Callable | None = None,
    *,
    mesh,
    schedule: Schedule | None = None,
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
    batch_argnums: int | Sequence[int] | None = None,
    region_ranks: dict | None = None,
):
    """Compile `fn` into one program per pipeline stage and run its forward.

    `fn` is cut at its `sxstage_iter` markers into `mesh.mpmd_dim x v` stages
    (`v = schedule.virtual_stages`, 1 without a schedule); each stage runs on
    its rank's submesh and its outputs are sent to the stages that read them.
    Traces once per signature: the argument structure, each leaf's shape, dtype
    and weak type, the values (and types) of `static_argnums`, and JAX's
    trace-affecting configuration. Usable as `@sxjit(mesh=...)`.

    Pipelined inference: with `batch_argnums` (and a schedule), those arguments
    are split on their leading axis into `schedule.microbatches`, the
    microbatches flow through the stages in the schedule's forward order, and
    every output (which must have a leading batch axis) comes back concatenated
    in batch order. Other arguments are broadcast to every microbatch, a PRNG
    key folded with the microbatch index, as in `sxvalue_and_grad`. `schedule`
    may be omitted when every stage sits in an `sxstage_region` with its own.

    `sxstage_region`s and `region_ranks` work as in `sxvalue_and_grad`.
    """
    if fn is None:  # `@sxjit(mesh=...)`: this call again, once given the function
        return functools.partial(sxjit, **{k: v for k, v in locals().items() if k != "fn"})
    settings = StepSettings.of("sxjit", locals() | {"mode": "forward"})
    return _JitFunction(fn, settings, as_tuple(donate_argnums))
