"""Public entry points: `sxjit`, `sxvalue_and_grad`, `sxgrad`."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core import sharding as core_sharding

from ._compile import Compiler
from ._mesh import MpmdMesh, as_mpmd_mesh
from ._plan import ForwardPlanBuilder, Plan, TrainPlanBuilder
from ._split import split, trace
from .errors import MpmdError, TraceContextError


def _as_tuple(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _check_not_traced(name: str, leaves: Sequence[Any]) -> None:
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        raise TraceContextError(
            f"{name} was called inside an outer JAX transformation (jax.jit, jax.grad, vmap, ...): "
            "an MPMD step compiles and runs one program per pipeline rank and cannot be traced "
            "into another program. Call it from plain Python (it is already compiled)."
        )


def _check_mesh(name: str, mesh) -> MpmdMesh:
    mesh = as_mpmd_mesh(mesh)
    if not mesh.is_mpmd:
        raise MpmdError(
            f"{name}: the mesh has no pipeline axis; build it with "
            "create_mesh(..., mpmd_axis='pp') (or pass a jax Mesh with a 'pp' axis)."
        )
    return mesh


def _check_schedule(name: str, schedule, n: int) -> int:
    if schedule is None:
        return 1
    if not hasattr(schedule, "actions"):
        raise MpmdError(
            f"{name}: schedule must be a schedule object (e.g. Std1F1B(microbatches=8)), got {schedule!r}."
        )
    try:
        schedule.validate(n)
    except ValueError as err:
        raise MpmdError(f"{name}: schedule {schedule!r} is not valid for {n} pipeline ranks: {err}") from err
    return schedule.virtual_stages


def _dtype(x):
    """The dtype of an array-like leaf (JAX/numpy array or Python scalar)."""
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def _leaf_key(x) -> tuple:
    return (np.shape(x), str(_dtype(x)))


def _leaf_ranges(args: Sequence[Any]) -> list[range]:
    """The flat-leaf indices of each positional argument."""
    ranges, start = [], 0
    for arg in args:
        n = len(jax.tree.leaves(arg))
        ranges.append(range(start, start + n))
        start += n
    return ranges


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
    grad_trees: tuple = ()  # per argnum: (treedef, per leaf a buffer slot or a zero array)

    def __post_init__(self):
        self.input_leaves = [a for _, (_, a, _) in self.plan.input_keys]
        self.cache_keys = [None if key[1] in self.donated else key for _, key in self.plan.input_keys]

    def place(self, placer: _Placer, leaves: Sequence) -> list:
        """The argument leaves the plan reads, each on the ranks that read it."""
        values = [leaves[a] for a in self.input_leaves]
        return placer.place(values, self.plan.input_shardings, self.cache_keys) if values else []

    def run(self, placer: _Placer, leaves: Sequence) -> list:
        """Place the arguments and run the plan; returns the buffers."""
        return self.plan.run(self.place(placer, leaves))


class _StepFunction:
    """The callable returned by `sxvalue_and_grad` / `sxgrad`."""

    def __init__(self, fn, argnums, mesh, schedule, has_aux, remat, rules, value: bool):
        self.fn, self.argnums = fn, _as_tuple(argnums)
        self.mesh = _check_mesh("sxvalue_and_grad", mesh)
        if schedule is None:
            raise MpmdError(
                "sxvalue_and_grad: a schedule is required, e.g. schedule=Std1F1B(microbatches=8)."
            )
        self.v = _check_schedule("sxvalue_and_grad", schedule, self.mesh.mpmd_dim)
        self.schedule, self.has_aux, self.remat, self.rules, self.value = (
            schedule,
            has_aux,
            remat,
            rules,
            value,
        )
        self.compiler = Compiler()
        self.placer = _Placer()
        self.cache: dict = {}
        functools.update_wrapper(self, fn)

    @property
    def n_stages(self) -> int:
        return self.mesh.mpmd_dim * self.v

    def _traced_fn(self):
        fn, has_aux = self.fn, self.has_aux

        def wrapped(*args):
            out = fn(*args)
            if has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise MpmdError("has_aux=True: the function must return a pair (loss, aux).")
                return out
            return out, None

        return wrapped

    def _build(self, args, leaves, in_tree) -> _Entry:
        m = self.schedule.microbatches
        for k in self.argnums:
            if not 0 <= k < len(args):
                raise MpmdError(
                    f"argnums={self.argnums}: the function was called with {len(args)} positional arguments."
                )
        bounds = _leaf_ranges(args)
        diff = [a for k in self.argnums for a in bounds[k]]
        batch = [a for a in range(len(leaves)) if a not in set(diff)]
        for a in diff:
            if not jax.dtypes.issubdtype(_dtype(leaves[a]), np.inexact):
                raise MpmdError(
                    f"sxvalue_and_grad: differentiated argument leaf {a} has dtype "
                    f"{_dtype(leaves[a])}; gradients need floating-point parameters. Move "
                    "integer arrays out of the differentiated arguments (argnums)."
                )
        micro = list(leaves)
        batch_avals = {}
        for a in batch:
            shape = np.shape(leaves[a])
            if not shape or shape[0] % m:
                raise MpmdError(
                    f"batch argument leaf {a} has shape {shape}: its leading (batch) axis must be "
                    f"divisible by schedule.microbatches={m}. Use a batch size that is a multiple of {m} "
                    "or change the number of microbatches."
                )
            dtype = _dtype(leaves[a])
            micro[a] = jax.ShapeDtypeStruct((shape[0] // m, *shape[1:]), dtype)
            batch_avals[a] = jax.core.ShapedArray(shape, dtype)
        for a in diff:
            micro[a] = jax.ShapeDtypeStruct(np.shape(leaves[a]), _dtype(leaves[a]))
        closed, _, out_tree = trace(self._traced_fn(), jax.tree.unflatten(in_tree, micro))
        loss_aval = closed.out_avals[0]
        if loss_aval.shape != () or not jax.dtypes.issubdtype(loss_aval.dtype, np.inexact):
            raise MpmdError(
                f"sxvalue_and_grad: the loss must be a floating-point scalar, got {loss_aval.str_short()}; "
                "reduce it (e.g. mean over the batch) before returning."
            )
        graph = split(closed, self.n_stages)
        specs = self._param_specs(args, bounds)
        builder = TrainPlanBuilder(
            graph,
            self.schedule,
            self.mesh,
            diff_args=diff,
            batch_args=batch,
            batch_avals=batch_avals,
            param_specs=specs,
            remat=self.remat,
            compiler=self.compiler,
        )
        plan = builder.build()
        first = NamedSharding(self.mesh.submesh(0), PartitionSpec())
        slots = plan.output_slots["grads"]

        def source(a):  # the gradient's buffer slot, or a zero array for a leaf no stage reads
            if a in slots:
                return slots[a]
            return jax.device_put(np.zeros(np.shape(leaves[a]), _dtype(leaves[a])), first)

        grad_trees = tuple(
            (jax.tree.structure(args[k]), [source(a) for a in bounds[k]]) for k in self.argnums
        )
        self.last_graph = graph
        return _Entry(plan, out_tree, grad_trees=grad_trees)

    def _param_specs(self, args, bounds) -> dict:
        if self.rules is None:
            return {}
        specs = {}
        for k in self.argnums:
            tree = core_sharding.param_specs(args[k], self.rules, mesh=self.mesh.submesh(0))
            leaves = jax.tree.structure(args[k]).flatten_up_to(tree)
            specs.update(zip(bounds[k], leaves))
        return specs

    def _entry(self, args):
        leaves, in_tree = jax.tree.flatten(args)
        _check_not_traced("sxvalue_and_grad", leaves)
        key = (in_tree, tuple(_leaf_key(x) for x in leaves))
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache[key] = self._build(args, leaves, in_tree)
        return entry, leaves

    def measure_peak_activations(self, *args) -> list[int]:
        """Run one step and return, per rank, the most `(stage, microbatch)` activations alive at once."""
        entry, leaves = self._entry(args)
        return entry.plan.peak_activations(entry.place(self.placer, leaves))

    def plan_for(self, *args) -> Plan:
        """The compiled plan (stage graph cells, dispatch order) for these arguments' signature."""
        return self._entry(args)[0].plan

    def __call__(self, *args):
        entry, leaves = self._entry(args)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        out = entry.plan.output_slots
        trees = [
            treedef.unflatten([buf[s] if isinstance(s, int) else s for s in sources])
            for treedef, sources in entry.grad_trees
        ]
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
) -> Callable:
    """Pipelined `jax.value_and_grad`: `step(params, batch) -> (loss, grads)`.

    The leading axis of every non-differentiated argument is split into
    `schedule.microbatches`; the loss is the mean of the microbatch losses and
    the gradients are its exact gradients, each leaf on the submesh of the rank
    that owns it (the first stage that reads it). `remat=True` recomputes each
    stage's forward in its backward instead of keeping residuals. `rules` (a
    `spectrax_core.sharding` rules object) shards each stage's parameters over
    its submesh; default replicated.
    """
    return _StepFunction(fn, argnums, mesh, schedule, has_aux, remat, rules, value=True)


def sxgrad(
    fn: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    mesh,
    schedule,
    has_aux: bool = False,
    remat: bool = False,
    rules=None,
) -> Callable:
    """Pipelined `jax.grad`: like `sxvalue_and_grad` but returns the gradients only (and aux)."""
    return _StepFunction(fn, argnums, mesh, schedule, has_aux, remat, rules, value=False)


class _JitFunction:
    """The callable returned by `sxjit`: runs `fn`'s stages, each on its own rank."""

    def __init__(self, fn, mesh, schedule, static_argnums, donate_argnums):
        self.fn = fn
        self.mesh = _check_mesh("sxjit", mesh)
        self.v = _check_schedule("sxjit", schedule, self.mesh.mpmd_dim)
        self.schedule = schedule
        self.static_argnums = _as_tuple(static_argnums)
        self.donate_argnums = _as_tuple(donate_argnums)
        self.compiler, self.placer, self.cache = Compiler(), _Placer(), {}
        functools.update_wrapper(self, fn)

    def _build(self, static, dynamic, dynamic_positions, leaves, in_tree) -> _Entry:
        statics = dict(static)

        def bound(*dyn):
            it = iter(dyn)
            full = [statics[k] if k in statics else next(it) for k in range(len(dyn) + len(statics))]
            return self.fn(*full)

        avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in leaves]
        closed, _, out_tree = trace(bound, jax.tree.unflatten(in_tree, avals))
        graph = split(closed, self.mesh.mpmd_dim * self.v)
        donated = frozenset(
            a
            for position, leaf_range in zip(dynamic_positions, _leaf_ranges(dynamic))
            if position in self.donate_argnums
            for a in leaf_range
        )
        builder = ForwardPlanBuilder(graph, self.schedule, self.mesh, compiler=self.compiler, donated=donated)
        self.last_graph = graph
        return _Entry(builder.build(), out_tree, donated=donated)

    def __call__(self, *args):
        for k in self.static_argnums:
            if not 0 <= k < len(args):
                raise MpmdError(
                    f"sxjit: static_argnums={self.static_argnums} but the call has {len(args)} arguments."
                )
        static = tuple((k, args[k]) for k in self.static_argnums)
        positions = [k for k in range(len(args)) if k not in self.static_argnums]
        dynamic = tuple(args[k] for k in positions)
        leaves, in_tree = jax.tree.flatten(dynamic)
        _check_not_traced("sxjit", leaves)
        try:
            key = (static, in_tree, tuple(_leaf_key(x) for x in leaves))
            hash(key)
        except TypeError as err:
            raise MpmdError(f"sxjit: static arguments must be hashable: {err}") from err
        entry = self.cache.get(key)
        if entry is None:
            entry = self.cache[key] = self._build(static, dynamic, positions, leaves, in_tree)
        buf = entry.run(self.placer, leaves)
        self.last_plan = entry.plan
        return jax.tree.unflatten(entry.out_tree, [buf[s] for s in entry.plan.output_slots["results"]])

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
):
    """Compile `fn` into one program per pipeline stage and run its forward.

    `fn` is cut at its `sxstage_iter` markers into `mesh.mpmd_dim x v` stages
    (`v = schedule.virtual_stages`, 1 without a schedule); each stage runs on
    its rank's submesh and its outputs are sent to the stages that read them.
    Traces once per signature: argument structure, shapes, dtypes and the
    values of `static_argnums`. Usable as `@sxjit(mesh=...)`.
    """
    if fn is None:
        return functools.partial(
            sxjit, mesh=mesh, schedule=schedule, static_argnums=static_argnums, donate_argnums=donate_argnums
        )
    return _JitFunction(fn, mesh, schedule, static_argnums, donate_argnums)
