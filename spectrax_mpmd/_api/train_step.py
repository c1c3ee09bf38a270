"""The whole training step as one traced function: the pipeline, then any JAX code on its results.

Inside `sxjit`, a `sxvalue_and_grad` step called on the function's arguments
is one equation (`spectrax_mpmd._trace.pipelined`). `build_train_step` makes
one plan of the function: the pipeline's cells, then every other equation (an
optax update, clipping, metrics) split by ownership and appended as an
`Epilogue`, so each leaf's update runs on the rank holding it, right after that
rank's last backward, and only the small values several ranks need cross.
`sxvalue_and_grad_and_apply` is that function written for an optax transformation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import optax

from .._plan import Epilogue, build_train_plan
from .._trace.args import as_tuple, signature
from .._trace.ownership import Program
from .._trace.pipelined import FoundCall, PipelineCall, sxpipeline_p
from ..errors import MpmdError
from .entry import Entry, build_plan
from .validation import VALIDATIONS, guarded_update


def bind_pipeline(step, args: Sequence):
    """`step(*args)` on traced arguments inside `sxjit`: one `sxpipeline_p` equation, returning
    what the step returns (`(value, grads)` or, for `sxgrad`, the gradients)."""
    sig = signature(step.name, step.fn, args, step.static_argnums)
    pipe = step.pipeline(sig)
    m = pipe.schedule.microbatches
    aux = [jax.core.ShapedArray((m, *a.shape), a.dtype) for a in pipe.graph.out_avals[1:]]
    params = [a for k in pipe.argnums for a in pipe.ranges[k]]
    grads = [jax.core.ShapedArray(sig.types[a][0], sig.types[a][1]) for a in params]
    call = PipelineCall(step, sig, pipe, (pipe.graph.out_avals[0], *aux, *grads), len(aux))
    outs = sxpipeline_p.bind(*sig.leaves, call=call)
    loss, aux_leaves, grad_leaves = outs[0], outs[1 : 1 + len(aux)], iter(outs[1 + len(aux) :])
    trees = [
        jax.tree.unflatten(
            sig.in_tree.children()[sig.positions.index(k)], [next(grad_leaves) for _ in pipe.ranges[k]]
        )
        for k in pipe.argnums
    ]
    g = trees[0] if len(trees) == 1 else tuple(trees)
    if step.has_aux:
        value = jax.tree.unflatten(pipe.out_tree, [loss, *aux_leaves])
        return (value, g) if step.value else (g, value[1])
    return (loss, g) if step.value else g


def build_train_step(owner, sig, found: FoundCall, out_tree, donated_leaves: frozenset) -> Entry:
    """The plan of a traced training step: `found`'s pipeline, then the rest of the function.

    The plan reads the function's leaves: a leaf the pipeline reads keeps its role there
    (a parameter's placement is shared with its update), every other leaf the rest reads
    is placed on each rank that reads it."""
    call: PipelineCall = found.call
    pipe = call.pipeline
    eqn = found.eqns[found.index]
    invars = list(found.invars)
    leaf_of = {v: j for j, v in enumerate(invars)}
    step_to_fn = [leaf_of[v] for v in eqn.invars]  # the function leaf each pipeline leaf reads
    params = [a for k in pipe.argnums for a in pipe.ranges[k]]
    param_of = {step_to_fn[a]: a for a in params}
    roles = [("param", param_of[j]) if j in param_of else ("input", j) for j in range(len(invars))]
    roles += [("loss",), *(("aux", j) for j in range(1, call.n_aux + 1)), *(("grad", a) for a in params)]
    donated = {("input", j) for j in donated_leaves} | {
        ("param", param_of[j]) for j in donated_leaves if j in param_of
    }
    program = Program(
        tuple(e for k, e in enumerate(found.eqns) if k != found.index),
        (*invars, *eqn.outvars),
        tuple(found.outvars),
        found.consts,
    )
    args = dataclasses.replace(pipe.args, epilogue=Epilogue(program, tuple(roles), frozenset(donated)))
    plan = build_plan(owner.compiler, build_train_plan, pipe.graph, pipe.schedule, owner.mesh, args)
    plan.input_keys = [
        (slot, key if key.kind == "input" else key._replace(leaf=step_to_fn[key.leaf]))
        for slot, key in plan.input_keys
    ]
    owner.last_graph = pipe.graph
    return Entry(plan, out_tree, donated=donated_leaves)


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
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    validation: str = "sync",
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
    microbatches. It is `sxjit` of the train step one would write by hand
    around `sxvalue_and_grad` (see `docs/mpmd.md`).

    `max_grad_norm` clips the gradients to that global norm (as
    `optax.clip_by_global_norm` before `tx`) and `skip_nonfinite=True` drops a
    step whose gradients are not finite (parameters and state unchanged).
    `validation="sync"` waits for the global norm before any rank updates;
    `"post"` updates each rank as soon as its backward ends and recomputes
    only when clipping triggers or a value is not finite: the same numbers,
    without the wait (see `spectrax_mpmd._api.validation`).
    """
    from .grad import sxvalue_and_grad
    from .jit import sxjit

    name = "sxvalue_and_grad_and_apply"
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise MpmdError(
            f"{name}: tx must be an optax.GradientTransformation (with init and update), got {type(tx).__name__}."
        )
    grad_step = sxvalue_and_grad(
        fn,
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
    if validation not in VALIDATIONS:
        raise MpmdError(f"{name}: validation must be one of {VALIDATIONS}, got {validation!r}.")
    grad_step.name = name

    def train_step(*call_args):
        if len(call_args) < 2:
            raise MpmdError(f"{name}: call the step as step(params, opt_state, *batch).")
        params, opt_state, *args = call_args
        check_state(name, tx, params, opt_state)
        value, grads = grad_step(params, *args)
        params, opt_state = guarded_update(
            tx,
            params,
            opt_state,
            grads,
            max_grad_norm=max_grad_norm,
            skip_nonfinite=skip_nonfinite,
            validation=validation,
        )
        return value, params, opt_state

    shifted = tuple(k + 1 if k > 0 else k for k in as_tuple(static_argnums))
    return sxjit(train_step, mesh=mesh, static_argnums=shifted, donate_argnums=(0, 1) if donate else ())


def check_state(name: str, tx, params, opt_state) -> None:
    """Raise unless `opt_state` has the structure and leaf types of `tx.init(params)`."""
    expected = jax.eval_shape(tx.init, params)
    got, want = jax.tree.structure(opt_state), jax.tree.structure(expected)
    if got != want or any(
        (jax.typeof(x).shape, jax.typeof(x).dtype) != (y.shape, y.dtype)
        for x, y in zip(jax.tree.leaves(opt_state), jax.tree.leaves(expected))
    ):
        leaves = [f"{y.dtype}{list(y.shape)}" for y in jax.tree.leaves(expected)]
        raise MpmdError(
            f"{name}: opt_state (argument 1) does not match tx.init(params): expected the structure "
            f"{want} with leaves {leaves}, got {got}. Create it with tx.init(params) for these "
            "parameters and this tx."
        )
