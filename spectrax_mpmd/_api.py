"""Public entry points: `sxjit`, `sxvalue_and_grad`, `sxgrad`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from spectrax_core import sharding as core_sharding

from ._agree import InputsCheck
from ._args import Signature, as_tuple, classify, signature, traced_avals
from ._compile import Compiler
from ._context import check_no_trace
from ._live_bytes import measure_peak_bytes
from ._mesh import MpmdMesh, as_mpmd_mesh
from ._plan import Plan, TrainPlanBuilder
from ._plan_forward import ForwardPlanBuilder
from ._profile import HostProfile, profile_plan
from ._region import region_schedule
from ._split import split, trace
from ._stage_profile import StageProfile
from ._stage_profile import profile_plan as profile_stage_plan
from ._timeline import Timeline, measured_timeline
from .errors import MpmdError


def _check_mesh(name: str, mesh) -> MpmdMesh:
    mesh = as_mpmd_mesh(mesh)
    if not mesh.is_mpmd:
        raise MpmdError(
            f"{name}: the mesh has no pipeline axis; build it with "
            "create_mesh(..., mpmd_axis='pp') (or pass a jax Mesh with a 'pp' axis)."
        )
    return mesh


def _check_schedule(name: str, schedule, n: int) -> tuple[int, MpmdError | None]:
    """The schedule's virtual stages, and the error its table gives on all `n` ranks: raised at
    the first call unless the function has regions (each region's schedule is then checked
    on its own ranks)."""
    if schedule is None:
        return 1, None
    if not hasattr(schedule, "actions"):
        raise MpmdError(
            f"{name}: schedule must be a schedule object (e.g. Std1F1B(microbatches=8)), got {schedule!r}."
        )
    try:
        schedule.validate(n)
    except ValueError as err:
        return schedule.virtual_stages, MpmdError(
            f"{name}: schedule {schedule!r} is not valid for {n} pipeline ranks: {err}"
        )
    return schedule.virtual_stages, None


def _pipeline_schedule(owner, graph, regions: dict):
    """The schedule a traced function runs: the call's, or its regions' merged into one.

    Called twice: before the split with no graph (the trace opened no region, so the
    call's schedule must be valid on every rank) and after it."""
    if graph is not None and graph.has_regions:
        return region_schedule(
            graph, regions, owner.schedule, owner.mesh.mpmd_dim, owner.region_ranks, owner.name
        )
    if graph is None and regions:
        return None
    if owner.region_ranks is not None:
        raise MpmdError(
            f"{owner.name}: region_ranks places sxstage_regions, but the function opens none; "
            "drop region_ranks or wrap each branch in `with sxstage_region(name):`."
        )
    if owner.schedule_error is not None:
        raise owner.schedule_error
    return owner.schedule


class _Placer:
    """Places argument leaves on the ranks that read them.

    A `jax.Array` is immutable, so its placement is cached by identity and reused
    while the caller passes the same object; numpy arrays and Python values can
    change in place and are placed again on every call, and so are leaves whose
    key is None (donated ones, consumed by the call).
    """

    def __init__(self):
        self.cache: dict = {}

    def place(self, values: list, shardings: list, keys: list) -> list:
        out: list = [None] * len(values)
        miss_v, miss_s, miss_i = [], [], []
        for k, (v, sh, key) in enumerate(zip(values, shardings, keys)):
            hit = self.cache.get(key) if key is not None else None
            if hit is not None and hit[0] is v and isinstance(v, jax.Array):
                out[k] = hit[1]
            else:
                miss_v.append(v)
                miss_s.append(sh)
                miss_i.append(k)
        if miss_v:
            placed = jax.device_put(miss_v, miss_s)
            for k, p in zip(miss_i, placed):
                out[k] = p
                if keys[k] is not None and isinstance(values[k], jax.Array):
                    self.cache[keys[k]] = (values[k], p)
        return out


@dataclass
class _Entry:
    """A compiled plan with what a call needs around it, all fixed per signature."""

    plan: Plan
    out_tree: Any
    donated: frozenset = frozenset()
    grad_trees: tuple = ()  # per argnum: (treedef, the buffer slot of each leaf's gradient)

    def __post_init__(self):
        self.input_leaves = [a for _, (_, a, _) in self.plan.input_keys]
        self.cache_keys = [None if key[1] in self.donated else key for _, key in self.plan.input_keys]
        self.build: dict = {}  # the build's BuildStats report; first_run is filled by the first run
        self.ran = False

    def place(self, placer: _Placer, leaves: Sequence) -> list:
        """The argument leaves the plan reads, each on the ranks that read it."""
        values = [leaves[a] for a in self.input_leaves]
        return placer.place(values, self.plan.input_shardings, self.cache_keys) if values else []

    def run(self, placer: _Placer, leaves: Sequence) -> list:
        """Place the arguments and run the plan; returns the buffers."""
        if self.ran or not self.build:
            return self.plan.run(self.place(placer, leaves))
        start = time.perf_counter()
        buf = self.plan.run(self.place(placer, leaves))
        self.build["seconds"]["first_run"] = time.perf_counter() - start
        self.build["total_s"] = sum(self.build["seconds"].values())
        self.ran = True
        return buf


def _cached_entry(owner, args) -> tuple[_Entry, list]:
    """`owner`'s entry for this call's signature (built on a miss) and the call's leaves.

    Refuses calls under a JAX transformation before any cache is read or written.
    """
    check_no_trace(owner.name)
    sig = signature(owner.name, owner.fn, args, owner.static_argnums)
    entry = owner.cache.get(sig.key)
    owner.inputs_check(sig, first=entry is None)
    if entry is None:
        stats = owner.compiler.stats
        stats.reset()
        with stats.timed("plan"):
            entry = owner._build(sig)
        entry.build = stats.report()
        owner.cache[sig.key] = entry
    owner.last_entry = entry
    return entry, sig.leaves


def _profile(owner, args, rounds: int) -> HostProfile:
    """`owner`'s host-cost report for these arguments (see `HostProfile`)."""
    entry, leaves = _cached_entry(owner, args)
    entry.plan.check_single_process(f"{owner.name}.profile")
    if entry.donated:
        raise MpmdError(
            f"{owner.name}.profile runs the call {2 * rounds} times on the same arguments, but "
            "donate_argnums lets the first run consume them; profile the function without donate_argnums."
        )
    return profile_plan(entry.plan, entry.place(owner.placer, leaves), rounds)


def _timings(owner, args) -> dict:
    """The build report of `args`' signature (building it if needed), or of the last call's."""
    if args:
        return _cached_entry(owner, args)[0].build
    entry = getattr(owner, "last_entry", None)
    if entry is None:
        raise MpmdError(f"{owner.name}: nothing has been built yet; call it first or pass arguments.")
    return entry.build


def _build_plan(compiler: Compiler, builder) -> Plan:
    """Run a plan builder; the compiler keeps its compiled programs but no per-build lowerings."""
    try:
        return builder.build()
    finally:
        compiler.forget_lowerings()


class _StepFunction:
    """The callable returned by `sxvalue_and_grad` / `sxgrad`."""

    def __init__(
        self,
        fn,
        argnums,
        mesh,
        schedule,
        has_aux,
        remat,
        rules,
        value,
        batch_argnums,
        static_argnums,
        reduce,
        region_ranks=None,
    ):
        self.name = "sxvalue_and_grad" if value else "sxgrad"
        self.fn, self.argnums = fn, as_tuple(argnums)
        self.batch_argnums = None if batch_argnums is None else as_tuple(batch_argnums)
        self.static_argnums = as_tuple(static_argnums)
        self.mesh = _check_mesh(self.name, mesh)
        if schedule is None:
            raise MpmdError(f"{self.name}: a schedule is required, e.g. schedule=Std1F1B(microbatches=8).")
        if reduce not in ("mean", "sum"):
            raise MpmdError(
                f"{self.name}: reduce must be 'mean' (the loss and gradients are averaged over "
                f"microbatches) or 'sum' (added up), got {reduce!r}."
            )
        self.v, self.schedule_error = _check_schedule(self.name, schedule, self.mesh.mpmd_dim)
        self.schedule, self.has_aux, self.remat, self.rules = schedule, has_aux, remat, rules
        self.region_ranks = region_ranks
        self.value, self.reduce = value, reduce
        self.compiler = Compiler()
        self.placer = _Placer()
        self.inputs_check = InputsCheck(self.name, fn, self.mesh)
        self.cache: dict = {}
        functools.update_wrapper(self, fn)

    @property
    def n_stages(self) -> int:
        return self.mesh.mpmd_dim * self.v

    def _traced_fn(self, fn):
        has_aux = self.has_aux

        def wrapped(*args):
            out = fn(*args)
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise MpmdError("has_aux=True: the function must return a pair (loss, aux).")
                return out
            return out, None

        return wrapped

    def _build(self, sig: Signature) -> _Entry:
        m = self.schedule.microbatches
        kinds = classify(self.name, self.fn, sig, self.argnums, self.batch_argnums, m)
        micro = traced_avals(sig, kinds, m)
        with self.compiler.stats.timed("trace"):
            closed, _, out_tree, regions = trace(
                self._traced_fn(sig.bind(self.fn)), sig.in_tree.unflatten(micro)
            )
        loss_aval = closed.out_avals[0]
        if loss_aval.shape != () or not jax.dtypes.issubdtype(loss_aval.dtype, np.inexact):
            raise MpmdError(
                f"{self.name}: the loss must be a floating-point scalar, got {loss_aval.str_short()}; "
                "reduce it (e.g. mean over the batch) before returning."
            )
        _pipeline_schedule(self, None, regions)
        with self.compiler.stats.timed("split"):
            graph = split(closed, self.n_stages)
        schedule = _pipeline_schedule(self, graph, regions)
        dynamic = sig.in_tree.unflatten(sig.leaves)
        ranges = dict(zip(sig.positions, sig.ranges()))
        builder = TrainPlanBuilder(
            graph,
            schedule,
            self.mesh,
            diff_args=kinds.params,
            batch_args=kinds.batch,
            batch_avals={a: sig.aval(a) for a in kinds.batch},
            param_specs=self._param_specs(dynamic, sig, kinds.argnums, ranges),
            remat=self.remat,
            compiler=self.compiler,
            keys=kinds.keys,
            reduce=self.reduce,
        )
        plan = _build_plan(self.compiler, builder)
        slots = plan.output_slots["grads"]
        grad_trees = tuple(
            (sig.in_tree.children()[sig.positions.index(k)], [slots[a] for a in ranges[k]])
            for k in kinds.argnums
        )
        self.last_graph = graph
        return _Entry(plan, out_tree, grad_trees=grad_trees)

    def _param_specs(self, dynamic, sig: Signature, argnums, ranges) -> dict:
        if self.rules is None:
            return {}
        specs = {}
        for k in argnums:
            arg = dynamic[sig.positions.index(k)]
            tree = core_sharding.param_specs(arg, self.rules, mesh=self.mesh.submesh(0))
            specs.update(zip(ranges[k], jax.tree.structure(arg).flatten_up_to(tree)))
        return specs

    def _entry(self, args):
        return _cached_entry(self, args)

    def measure_peak_activations(self, *args) -> list[int]:
        """Run one step and return, per rank, the most `(stage, microbatch)` activations alive at once."""
        entry, leaves = self._entry(args)
        return entry.plan.peak_activations(entry.place(self.placer, leaves))

    def measure_peak_bytes(self, *args) -> tuple[int, ...]:
        """Run one step and return, per rank, the most bytes alive on its devices between actions
        (its most loaded device: parameters, batch, accumulators and every activation, residual,
        stash and cotangent in flight; temporaries inside a cell are not counted). The step's
        results are discarded."""
        entry, leaves = self._entry(args)
        return measure_peak_bytes(entry.plan, entry.place(self.placer, leaves))

    def measure_timeline(self, *args) -> Timeline:
        """Run one step cell by cell, timing each, as a `spectrax_core.schedules.Timeline` in µs.

        Each action is one event on its rank (its cell plus the sends after it);
        `spectrax_core.schedules.chrome_trace(timeline, us_per_unit=1)` turns it
        into a Chrome trace (one track per rank, slices named like `2F5`).
        """
        entry, leaves = self._entry(args)
        schedule, n = entry.plan.schedule, self.mesh.mpmd_dim
        spans = entry.plan.timeline(entry.place(self.placer, leaves))
        return measured_timeline(spans, n, repr(schedule), schedule.stage_labels(n))

    def profile(self, *args, rounds: int = 7) -> HostProfile:
        """Host cost of one step on these arguments: issue CPU time per rank and cell kind, call
        and transfer counts, and the share of the step spent issuing (`HostProfile`; print
        `.table()`). Runs the step `2 * rounds` times."""
        return _profile(self, args, rounds)

    def profile_stages(self, *args, rounds: int = 3) -> StageProfile:
        """Per stage and cell kind, for these arguments: XLA's cost and memory analysis of the
        compiled cells, what each forward saves (and each I cell stashes) per microbatch, each
        rank's parameter and accumulator bytes, bytes per edge, the bytes each stage and rank
        holds (`.stage_memory()`), and each cell's measured time (`StageProfile`; print
        `.table()`). Runs the step `rounds` times cell by cell, and once more to size its buffers."""
        entry, leaves = self._entry(args)
        entry.plan.check_single_process(f"{self.name}.profile_stages")
        try:
            return profile_stage_plan(
                entry.plan,
                self.compiler.compile_spec,
                dict(enumerate(leaves)),
                entry.place(self.placer, leaves),
                rounds,
            )
        finally:
            self.compiler.forget_lowerings()

    def timings(self, *args) -> dict:
        """Where the first call's time went, for these arguments' signature (default: the last
        call's): seconds per phase (trace, split, lower, compile, relocate, plan, first_run;
        see `BuildStats`), their total, and how many programs were compiled and relocated."""
        return _timings(self, args)

    def plan_for(self, *args) -> Plan:
        """The compiled plan (stage graph cells, dispatch order) for these arguments' signature."""
        return self._entry(args)[0].plan

    def __call__(self, *args):
        entry, leaves = self._entry(args)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        out = entry.plan.output_slots
        trees = [treedef.unflatten([buf[s] for s in slots]) for treedef, slots in entry.grad_trees]
        grads = trees[0] if len(trees) == 1 else tuple(trees)
        loss = buf[out["loss"]]
        if self.has_aux:
            aux_leaves = [buf[out["aux"][j]] for j in sorted(out["aux"])]
            (_, aux) = jax.tree.unflatten(entry.out_tree, [loss, *aux_leaves])
            value = (loss, aux)
        else:
            value = loss
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
    schedule,
    has_aux: bool = False,
    remat: bool = False,
    rules=None,
    batch_argnums: int | Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
    reduce: str = "mean",
    region_ranks: dict | None = None,
) -> Callable:
    """Pipelined `jax.value_and_grad`: `step(params, batch, ...) -> (loss, grads)`.

    Arguments are of four kinds. `argnums` are the parameters (differentiated,
    never split). `batch_argnums` (default: every other non-static argument)
    are split on their shared leading axis into `schedule.microbatches`. Every
    other non-static argument is broadcast: the same value reaches every
    microbatch, and a PRNG key among them reaches microbatch `i` as
    `jax.random.fold_in(key, i)`. `static_argnums` are hashed into the cache key
    and bound into the trace, as in `jax.jit`.

    The loss is the mean (`reduce="mean"`) or the sum (`"sum"`) of the
    microbatch losses, and the gradients are its exact gradients, each leaf on
    the submesh of the rank that owns it (the first stage that reads it).
    `remat=True` recomputes each stage's forward in its backward instead of
    keeping residuals. `rules` (a `spectrax_core.sharding` rules object) shards
    each stage's parameters over its submesh; default replicated.

    A function with `sxstage_region`s runs each region's stages on its own ranks
    with its own schedule (`schedule` is the default region's); `region_ranks`
    (`{region name: (rank, ...)}`, `"default"` for the code outside regions)
    places them, by default on consecutive ranks of their own.
    """
    return _StepFunction(
        fn,
        argnums,
        mesh,
        schedule,
        has_aux,
        remat,
        rules,
        True,
        batch_argnums,
        static_argnums,
        reduce,
        region_ranks,
    )


def sxgrad(
    fn: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    mesh,
    schedule,
    has_aux: bool = False,
    remat: bool = False,
    rules=None,
    batch_argnums: int | Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
    reduce: str = "mean",
    region_ranks: dict | None = None,
) -> Callable:
    """Pipelined `jax.grad`: like `sxvalue_and_grad` but returns the gradients only (and aux)."""
    return _StepFunction(
        fn,
        argnums,
        mesh,
        schedule,
        has_aux,
        remat,
        rules,
        False,
        batch_argnums,
        static_argnums,
        reduce,
        region_ranks,
    )


class _JitFunction:
    """The callable returned by `sxjit`: runs `fn`'s stages, each on its own rank."""

    def __init__(self, fn, mesh, schedule, static_argnums, donate_argnums, batch_argnums, region_ranks=None):
        self.fn, self.name = fn, "sxjit"
        self.mesh = _check_mesh("sxjit", mesh)
        self.v, self.schedule_error = _check_schedule("sxjit", schedule, self.mesh.mpmd_dim)
        self.schedule, self.region_ranks = schedule, region_ranks
        if batch_argnums is not None and schedule is None:
            raise MpmdError(
                "sxjit: batch_argnums splits the batch into the schedule's microbatches; pass a "
                "schedule too, e.g. schedule=GPipe(microbatches=4)."
            )
        self.batch_argnums = None if batch_argnums is None else as_tuple(batch_argnums)
        self.static_argnums = as_tuple(static_argnums)
        self.donate_argnums = as_tuple(donate_argnums)
        self.compiler, self.placer, self.cache = Compiler(), _Placer(), {}
        self.inputs_check = InputsCheck(self.name, fn, self.mesh)
        functools.update_wrapper(self, fn)

    def _build(self, sig: Signature) -> _Entry:
        kinds, split_batch = None, {}
        if self.batch_argnums is not None:
            kinds = classify("sxjit", self.fn, sig, (), self.batch_argnums, self.schedule.microbatches)
            split_batch = dict(
                batch_args=kinds.batch, batch_avals={a: sig.aval(a) for a in kinds.batch}, keys=kinds.keys
            )
        avals = traced_avals(sig, kinds, self.schedule.microbatches if kinds is not None else 1)
        with self.compiler.stats.timed("trace"):
            closed, _, out_tree, regions = trace(sig.bind(self.fn), sig.in_tree.unflatten(avals))
        _pipeline_schedule(self, None, regions)
        with self.compiler.stats.timed("split"):
            graph = split(closed, self.mesh.mpmd_dim * self.v)
        schedule = _pipeline_schedule(self, graph, regions)
        n_args = len(sig.positions) + len(sig.statics)
        donate = {k % n_args for k in self.donate_argnums if -n_args <= k < n_args}
        donated = frozenset(
            a
            for position, leaf_range in zip(sig.positions, sig.ranges())
            if position in donate
            for a in leaf_range
        )
        builder = ForwardPlanBuilder(
            graph, schedule, self.mesh, compiler=self.compiler, donated=donated, **split_batch
        )
        self.last_graph = graph
        return _Entry(_build_plan(self.compiler, builder), out_tree, donated=donated)

    def __call__(self, *args):
        entry, leaves = _cached_entry(self, args)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        return jax.tree.unflatten(entry.out_tree, [buf[s] for s in entry.plan.output_slots["results"]])

    def profile(self, *args, rounds: int = 7) -> HostProfile:
        """Host cost of one call (see `sxvalue_and_grad(...).profile`)."""
        return _profile(self, args, rounds)

    def timings(self, *args) -> dict:
        """Where the first call's time went (see `sxvalue_and_grad(...).timings`)."""
        return _timings(self, args)

    @property
    def dispatch_log(self) -> list:
        return list(self.last_plan.log)


def sxjit(
    fn: Callable | None = None,
    *,
    mesh,
    schedule=None,
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
    key folded with the microbatch index, as in `sxvalue_and_grad`.

    `sxstage_region`s and `region_ranks` work as in `sxvalue_and_grad`.
    """
    if fn is None:
        return functools.partial(
            sxjit,
            mesh=mesh,
            schedule=schedule,
            static_argnums=static_argnums,
            donate_argnums=donate_argnums,
            batch_argnums=batch_argnums,
            region_ranks=region_ranks,
        )
    return _JitFunction(fn, mesh, schedule, static_argnums, donate_argnums, batch_argnums, region_ranks)


def profile_stages(fn: Callable, *args, mesh, schedule, rounds: int = 3, **step_kwargs) -> StageProfile:
    """`sxvalue_and_grad(fn, mesh=, schedule=, **step_kwargs).profile_stages(*args)`: the
    per-stage profile of `fn`'s pipelined training step on these arguments."""
    step = sxvalue_and_grad(fn, mesh=mesh, schedule=schedule, **step_kwargs)
    return step.profile_stages(*args, rounds=rounds)
