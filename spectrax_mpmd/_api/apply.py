"""`sxvalue_and_grad_and_apply`: the loss, its gradients and the optimizer update as one plan.

The update is an ordinary optax step traced after the pipeline's gradient
reduction and split by ownership (`spectrax_mpmd._plan.epilogue`): each leaf's
update runs on the rank that holds the leaf, right after that rank's last
backward; a value several ranks need (a global gradient norm, a finiteness flag)
crosses ranks as the scalar it is. Parameters and optimizer state are donated.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import optax

from .._compile.compiler import Compiler
from .._plan import Epilogue, build_train_plan
from .._runtime import Plan
from .._trace.args import signature
from .._trace.context import check_no_trace
from ..errors import MpmdError
from .entry import Entry, build_plan
from .grad import _StepFunction


def _avals(leaves) -> list:
    return [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak) for shape, dtype, weak in map(_typed, leaves)]


def _typed(x) -> tuple:
    aval = jax.typeof(x)
    return aval.shape, aval.dtype, aval.weak_type


class _ApplyStep:
    """The callable returned by `sxvalue_and_grad_and_apply`."""

    name = "sxvalue_and_grad_and_apply"

    def __init__(self, fn, tx: optax.GradientTransformation, *, donate: bool, **step_kwargs):
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise MpmdError(
                f"{self.name}: tx must be an optax.GradientTransformation (with init and update), "
                f"got {type(tx).__name__}."
            )
        self.pipe = _StepFunction(fn, 0, value=True, **step_kwargs)
        self.pipe.name = self.name
        self.tx, self.donate = tx, donate
        self.mesh = self.pipe.mesh
        self.cache: dict = {}
        functools.update_wrapper(self, fn)

    def _key(self, args: Sequence) -> tuple:
        if len(args) < 2:
            raise MpmdError(f"{self.name}: call the step as step(params, opt_state, *batch).")
        params, opt_state, *rest = args
        check_no_trace(self.name)
        sig = signature(self.name, self.pipe.fn, (params, *rest), self.pipe.static_argnums)
        state_leaves, state_tree = jax.tree.flatten(opt_state)
        types = tuple(_typed(x) for x in state_leaves)
        return sig, state_leaves, (sig.key, state_tree, types)

    def _entry(self, args: Sequence) -> tuple[Entry, list]:
        sig, state_leaves, key = self._key(args)
        entry = self.cache.get(key)
        self.pipe.inputs_check(sig, first=entry is None)
        if entry is None:
            stats = self.pipe.compiler.stats
            stats.reset()
            with stats.timed("plan"):
                entry = self._build(sig, args[0], args[1], state_leaves)
            entry.build = stats.report()
            self.cache[key] = entry
        self.last_entry = entry
        return entry, [*sig.leaves, *state_leaves]

    def _check_state(self, params, opt_state) -> None:
        expected = jax.eval_shape(self.tx.init, params)
        got, want = jax.tree.structure(opt_state), jax.tree.structure(expected)
        if got != want or any(
            (jax.typeof(x).shape, jax.typeof(x).dtype) != (y.shape, y.dtype)
            for x, y in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected))
        ):
            raise MpmdError(
                f"{self.name}: opt_state (argument 1) does not match tx.init(params): expected the "
                f"structure {want} with leaves {[f'{y.dtype}{list(y.shape)}' for y in jax.tree.leaves(expected)]}, "
                f"got {got}. Create it with tx.init(params) for these parameters and this tx."
            )

    def _build(self, sig, params, opt_state, state_leaves) -> Entry:
        self._check_state(params, opt_state)
        pipe = self.pipe.pipeline(sig)
        param_leaves = list(pipe.ranges[0])
        n_aux = len(pipe.graph.out_avals) - 1
        m = pipe.schedule.microbatches if hasattr(pipe.schedule, "microbatches") else 1
        aux_avals = [jax.ShapeDtypeStruct((m, *a.shape), a.dtype) for a in pipe.graph.out_avals[1:]]
        param_tree = jax.tree.structure(params)
        state_tree = jax.tree.structure(opt_state)
        has_aux, tx, out_tree = self.pipe.has_aux, self.tx, pipe.out_tree
        box = []

        def update(p_leaves, s_leaves, g_leaves, loss, aux_leaves):
            p = jax.tree.unflatten(param_tree, p_leaves)
            g = jax.tree.unflatten(param_tree, g_leaves)
            updates, state = tx.update(g, jax.tree.unflatten(state_tree, s_leaves), p)
            value = jax.tree.unflatten(out_tree, [loss, *aux_leaves]) if has_aux else loss
            out = (value, optax.apply_updates(p, updates), state)
            leaves, tree = jax.tree.flatten(out)
            box.append(tree)
            return leaves

        p_avals = [sig.aval(a) for a in param_leaves]
        closed = jax.make_jaxpr(update)(
            p_avals, _avals(state_leaves), p_avals, pipe.graph.out_avals[0], aux_avals
        )
        n_pipe = len(sig.leaves)
        state_ids = list(range(n_pipe, n_pipe + len(state_leaves)))
        roles = (
            *(("param", a) for a in param_leaves),
            *(("input", a) for a in state_ids),
            *(("grad", a) for a in param_leaves),
            ("loss",),
            *(("aux", j) for j in range(1, n_aux + 1)),
        )
        donated = frozenset((*param_leaves, *state_ids)) if self.donate else frozenset()
        args = dataclasses.replace(pipe.args, epilogue=Epilogue(closed, roles, donated))
        compiler: Compiler = self.pipe.compiler
        plan = build_plan(compiler, build_train_plan, pipe.graph, pipe.schedule, self.mesh, args)
        return Entry(plan, box[0], donated=donated)

    def __call__(self, *args):
        entry, leaves = self._entry(args)
        buf = entry.run(self.pipe.placer, leaves)
        self.last_plan = entry.plan
        return jax.tree.unflatten(entry.out_tree, [buf[s] for s in entry.plan.output_slots["results"]])

    def plan_for(self, *args) -> Plan:
        """The compiled plan (pipeline cells, then the update's cells) for these arguments."""
        return self._entry(args)[0].plan

    def timings(self, *args) -> dict:
        """Where the first call's time went (see `sxvalue_and_grad(...).timings`)."""
        if args:
            return self._entry(args)[0].build
        if not hasattr(self, "last_entry"):
            raise MpmdError(f"{self.name}: nothing has been built yet; call it first or pass arguments.")
        return self.last_entry.build

    @property
    def dispatch_log(self) -> list:
        """`(rank, action, cell)` for every action issued by the last call, in issue order."""
        return list(self.last_plan.log)


def sxvalue_and_grad_and_apply(
    fn: Callable,
    tx: optax.GradientTransformation,
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
    donate: bool = True,
) -> Callable:
    """One pipelined training step: `step(params, opt_state, *args) -> (loss, params, opt_state)`.

    `fn(params, *args)` is the loss, as for `sxvalue_and_grad` (whose other
    arguments this takes, with `argnums=0`). After the backward, `tx` (any optax
    transformation: chains, `clip_by_global_norm`, `apply_if_finite`,
    `multi_transform`, a hand-written per-matrix update) updates the
    parameters exactly as `tx.update` + `optax.apply_updates` on the whole tree
    would, each leaf on the rank that owns it. `opt_state` is `tx.init(params)`;
    the step returns it laid out where it is updated, and takes it back there.
    With `donate=True` (default) the step consumes `params` and `opt_state`
    (as `jax.jit(donate_argnums=...)`): keep only what it returns.
    With `has_aux=True` the first result is `(loss, aux)`, aux stacked over
    microbatches.
    """
    return _ApplyStep(
        fn,
        tx,
        donate=donate,
        mesh=mesh,
        schedule=schedule,
        has_aux=has_aux,
        remat=remat,
        rules=rules,
        batch_argnums=batch_argnums,
        static_argnums=static_argnums,
        reduce=reduce,
        region_ranks=region_ranks,
    )
