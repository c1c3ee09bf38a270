"""The pipeline entry points as `spx` names: `spectrax_mpmd`'s, also in the forms written for
`spectrax-lib`.

There, a loss is compiled once with `sxjit(mesh=, schedule=)` and differentiated with
`sxgrad(jitted)` / `sxvalue_and_grad(jitted)` / `sxvalue_and_grad_and_apply(jitted)`, the
mesh and schedule read from the jitted function and the gradients returned as a tuple with
one entry per differentiated argument. Here the same calls build `spectrax_mpmd`'s step
from the jitted function's loss and settings. Called with `mesh=` (the form of
`spectrax_mpmd`), each name is `spectrax_mpmd`'s own. `spectrax_mpmd` is imported on first
call (`mpmd.mpmd()`), so `import spectrax_eager` never needs it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from .mpmd import mpmd


def _argnums(argnums) -> tuple[int, ...]:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def sxjit(
    fn: Callable | None = None,
    *,
    mesh,
    schedule=None,
    static_argnums=(),
    static_argnames=None,
    donate_argnums=(),
    batch_argnums=None,
    in_shardings=None,
    out_shardings=None,
    **options,
):
    """`spectrax_mpmd.sxjit`, also taking `static_argnames` (turned into positions) and
    `in_shardings` / `out_shardings` left as None: each stage's placement comes from the
    stage markers and the arrays' sharding annotations."""
    for name, value in (("in_shardings", in_shardings), ("out_shardings", out_shardings)):
        if value is not None:
            raise mpmd().MpmdError(
                f"sxjit: {name}= is not taken here: each stage runs on its rank's submesh and the "
                "arrays inside it are placed by their sharding annotations "
                "(spx.with_sharding_constraint, sharding= on variables). Drop the argument."
            )
    settings = dict(mesh=mesh, schedule=schedule, donate_argnums=donate_argnums, batch_argnums=batch_argnums)
    if fn is None:
        return lambda f: sxjit(
            f, static_argnums=static_argnums, static_argnames=static_argnames, **settings, **options
        )
    static = _argnums(() if static_argnums is None else static_argnums)
    if static_argnames is not None:
        names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)
        positions = list(inspect.signature(fn).parameters)
        missing = [n for n in names if n not in positions]
        if missing:
            raise mpmd().MpmdError(f"sxjit: static_argnames {missing} are not parameters of {fn.__name__}.")
        static = tuple(dict.fromkeys(static + tuple(positions.index(n) for n in names)))
    settings["donate_argnums"] = () if donate_argnums is None else donate_argnums
    return mpmd().sxjit(fn, static_argnums=static, **settings, **options)


def _jitted_step(name: str, fn, argnums, value: bool):
    """The step of `spectrax_mpmd.sxvalue_and_grad` (`value`) or `sxgrad` for `sxjit`ted `fn`."""
    mp = mpmd()
    settings = getattr(fn, "settings", None)
    if not (isinstance(settings, mp.StepSettings) and settings.name == "sxjit"):
        raise TypeError(
            f"{name}: give a function compiled with spx.sxjit(mesh=..., schedule=...), or the loss itself "
            f"with mesh= and schedule= ({name}(loss, mesh=mesh, schedule=spx.GPipe(4)))."
        )
    if settings.schedule is None:
        raise TypeError(f"{name}: the sxjit function needs a schedule (spx.sxjit(mesh=..., schedule=...)).")
    make = mp.sxvalue_and_grad if value else mp.sxgrad
    return make(fn.fn, argnums, mesh=settings.mesh, schedule=settings.schedule, **settings.keywords())


def sxgrad(fn: Callable, argnums=0, *, mesh=None, **options) -> Callable:
    """`spectrax_mpmd.sxgrad(fn, argnums, mesh=..., ...)`; or, for an `sxjit`ted `fn` without
    `mesh=`, the gradients of its loss as a tuple, one entry per `argnums` position."""
    if mesh is not None:
        return mpmd().sxgrad(fn, argnums, mesh=mesh, **options)
    _no_options("sxgrad", options)
    step = _jitted_step("sxgrad", fn, argnums, value=False)
    many = len(_argnums(argnums)) > 1  # the step returns one tree for one position
    return lambda *args: tuple(step(*args)) if many else (step(*args),)


def sxvalue_and_grad(fn: Callable, argnums=0, *, mesh=None, **options) -> Callable:
    """`spectrax_mpmd.sxvalue_and_grad(fn, argnums, mesh=..., ...)`; or, for an `sxjit`ted `fn`
    without `mesh=`, `(loss, gradients)` with the gradients a tuple, one per `argnums` position."""
    if mesh is not None:
        return mpmd().sxvalue_and_grad(fn, argnums, mesh=mesh, **options)
    _no_options("sxvalue_and_grad", options)
    step = _jitted_step("sxvalue_and_grad", fn, argnums, value=True)
    many = len(_argnums(argnums)) > 1  # the step returns one tree for one position

    def value_and_grad(*args):
        loss, grads = step(*args)
        return loss, tuple(grads) if many else (grads,)

    return value_and_grad


def _no_options(name: str, options: dict) -> None:
    if options:
        raise TypeError(
            f"{name}: {sorted(options)} are settings of the step built from a loss (give mesh= too); "
            "for an sxjit function they come from spx.sxjit."
        )


def _is_transformation(x) -> bool:
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def sxvalue_and_grad_and_apply(fn: Callable, argnums=0, **options) -> Callable:
    """The loss, its gradients and the parameters' update in one call.

    `sxvalue_and_grad_and_apply(loss, tx, mesh=..., ...)` (an optax transformation second) is
    `spectrax_mpmd.sxvalue_and_grad_and_apply`: one compiled step, each leaf updated on its rank.

    `sxvalue_and_grad_and_apply(jitted, argnums=0)` (an `sxjit`ted loss) returns
    `step(*args, apply_fn, opt_state, learning_rate_fn=None, **context) -> (loss, new_params,
    new_opt_state)`: after the pipelined backward, `apply_fn(rank=r, grad_accums=..., state=...)`
    is called for each rank in order. `grad_accums` maps the flat index of each leaf (counted
    over the positional arguments' leaves in order) that rank `r` owns to its gradient (the
    same gradient `sxvalue_and_grad` returns); `state` holds `params` (the first
    differentiated argument), `opt_state`, `learning_rate_fn`, `leaf_stage_owners` (flat
    index -> rank), `rank_submeshes`, `grads_for_log`, the extra keywords, and the buffers
    `new_params_buf` / `new_opt_state_buf` that `apply_fn` writes under its rank. The results
    are what `state["assemble_outputs"](state)` returns when given, else the last rank's buffers.
    """
    if _is_transformation(argnums):
        return mpmd().sxvalue_and_grad_and_apply(fn, argnums, **options)
    _no_options("sxvalue_and_grad_and_apply", options)
    value_and_grad = sxvalue_and_grad(fn, argnums)
    positions = _argnums(argnums)
    mesh = fn.mesh

    def step(*args, apply_fn: Callable, opt_state: Any, learning_rate_fn: Any = None, **context):
        import jax

        loss, grads = value_and_grad(*args)
        n_args = len(args)
        offsets = [0]
        for arg in args:
            offsets.append(offsets[-1] + len(jax.tree.leaves(arg)))
        flat: dict[int, Any] = {}
        for k, g in zip(positions, grads):
            for i, leaf in enumerate(jax.tree.leaves(g)):
                flat[offsets[k % n_args] + i] = leaf
        owners = {i: _owner(mesh, leaf) for i, leaf in flat.items()}
        state = {
            "apply_fn": apply_fn,
            "params": args[positions[0]],
            "opt_state": opt_state,
            "learning_rate_fn": learning_rate_fn,
            "leaf_stage_owners": owners,
            "rank_submeshes": tuple(mesh.submesh(r) for r in range(mesh.mpmd_dim)),
            "grads_for_log": grads,
            "new_params_buf": {},
            "new_opt_state_buf": {},
            **context,
        }
        for rank in range(mesh.mpmd_dim):
            mine = {i: g for i, g in flat.items() if owners[i] == rank}
            apply_fn(rank=rank, grad_accums=mine, state=state)
        assemble = state.get("assemble_outputs")
        if callable(assemble):
            new_params, new_opt_state = assemble(state)
        elif state["new_params_buf"] and state["new_opt_state_buf"]:
            last = max(state["new_params_buf"])
            new_params, new_opt_state = state["new_params_buf"][last], state["new_opt_state_buf"][last]
        else:
            raise mpmd().MpmdError(
                "sxvalue_and_grad_and_apply: apply_fn wrote no new_params_buf[rank] / "
                "new_opt_state_buf[rank] in state, and no state['assemble_outputs'] was given."
            )
        return loss, new_params, new_opt_state

    return step


def _owner(mesh, leaf) -> int:
    """The pipeline rank whose submesh holds `leaf` (rank 0 for a leaf on no single rank)."""
    rank = mesh.rank_of(leaf)
    return 0 if rank is None else rank


def sxstage_region(
    name: str | Callable | None = None,
    *,
    schedule=None,
    batch_argnums=None,
    static_argnums=None,
    donate_argnums=None,
):
    """`spectrax_mpmd.sxstage_region(name, schedule)`; `sxstage_region(fn)` runs `fn` as the
    region named `fn.__name__`. A region takes the call's batch, static and donated arguments,
    so `batch_argnums` / `static_argnums` / `donate_argnums` must be left as None."""
    mp = mpmd()
    for key, value in (
        ("batch_argnums", batch_argnums),
        ("static_argnums", static_argnums),
        ("donate_argnums", donate_argnums),
    ):
        if value is not None:
            raise mp.StageSplitError(
                f"sxstage_region: {key}= is not taken: a region's arguments are the call's; give "
                f"{key} to sxjit / sxvalue_and_grad."
            )
    if callable(name):
        return mp.sxstage_region(name.__name__, schedule)(name)
    if name is None:
        raise mp.StageSplitError(
            "sxstage_region: name the region (sxstage_region('vision')) or decorate a function with it "
            "(its name is the region's); regions are told apart by name."
        )
    return mp.sxstage_region(name, schedule)
