"""`sxvalue_and_grad_and_apply`: the loss, its gradients and an optax update as one plan.

It is `sxjit` of the train step one would write by hand around
`sxvalue_and_grad`: the update is split by ownership (`train_step`), each leaf's
update on its rank; clipping and non-finite skips are synchronous or validated
after the fact (`validation`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import optax

from spectrax_core.schedules import Schedule

from .._settings import StepSettings
from ..errors import MpmdError
from .bucketed import InnerStep
from .grad import _StepFunction
from .jit import sxjit
from .validation import VALIDATIONS, guarded_update


def sxvalue_and_grad_and_apply(
    fn: Callable,
    tx: optax.GradientTransformation,
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
    update_kwargs: Callable | None = None,
    donate: bool = True,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
    validation: str = "sync",
    length_buckets=None,
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
    around `sxvalue_and_grad` (see `docs/training.md`).

    `max_grad_norm` clips the gradients to that global norm (as
    `optax.clip_by_global_norm` before `tx`) and `skip_nonfinite=True` drops a
    step whose gradients are not finite (parameters and state unchanged).
    `validation="sync"` waits for the global norm before any rank updates;
    `"post"` updates each rank as soon as its backward ends and recomputes
    only when clipping triggers or a value is not finite: the same numbers,
    without the wait (see `spectrax_mpmd._api.validation`). With neither
    `max_grad_norm` nor `skip_nonfinite` `validation` changes nothing: the
    update is gated only by what `tx` reads (`"none"` in
    `spectrax_core.schedules.VALIDATIONS` unless it reads another rank's
    gradients; a clip inside `tx` waits, as `"sync"`).

    `tx.update` receives `value=loss` when `tx` takes extra arguments
    (`optax.GradientTransformationExtraArgs`: `optax.contrib.reduce_on_plateau`,
    `optax.polyak_sgd` in a chain), and whatever `update_kwargs(loss, aux)` returns
    (a dict; `aux` is None without `has_aux`).

    `length_buckets=LengthBuckets(lengths=k)` runs each microbatch at its rows' length bucket, as
    `sxvalue_and_grad` does (`k` names one of `fn`'s arguments, not the step's), the update after
    it in the same plan.
    """
    settings = StepSettings.of("sxvalue_and_grad_and_apply", locals())
    if tx is None:
        raise MpmdError(
            f"{settings.name}: tx must be an optax.GradientTransformation (with init and update), got None."
        )
    update = Update(update_kwargs, donate, max_grad_norm, skip_nonfinite, validation)
    return apply_step(fn, settings, update)


@dataclass(frozen=True)
class Update:
    """How a whole training step updates the parameters after `tx` (see
    `sxvalue_and_grad_and_apply`)."""

    update_kwargs: Callable | None = None
    donate: bool = True
    max_grad_norm: float | None = None
    skip_nonfinite: bool = False
    validation: str = "sync"

    def check(self, name: str) -> None:
        if self.update_kwargs is not None and not callable(self.update_kwargs):
            raise MpmdError(
                f"{name}: update_kwargs must be a function (loss, aux) -> dict of tx.update's keyword "
                f"arguments, got {type(self.update_kwargs).__name__}."
            )
        if self.validation not in VALIDATIONS:
            raise MpmdError(f"{name}: validation must be one of {VALIDATIONS}, got {self.validation!r}.")


UPDATE_OPTIONS = frozenset(f.name for f in fields(Update))


def apply_step(fn: Callable, settings: StepSettings, update: Update = Update()) -> Callable:
    """The whole training step of `fn` with `settings` (`settings.tx` the optimizer), updated as
    `update` says: what `sxvalue_and_grad_and_apply` returns."""
    name, tx, has_aux = settings.name, settings.tx, settings.has_aux
    update.check(name)

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
            max_grad_norm=update.max_grad_norm,
            skip_nonfinite=update.skip_nonfinite,
            validation=update.validation,
            extra=update_arguments(name, tx, value if has_aux else (value, None), update.update_kwargs),
        )
        return value, params, opt_state

    shifted = tuple(k + 1 if k > 0 else k for k in settings.static_argnums)
    donated = (0, 1) if update.donate else ()
    step = sxjit(train_step, mesh=settings.mesh, static_argnums=shifted, donate_argnums=donated)
    grad_step = _StepFunction(fn, settings, compiler=step.compiler)  # one build report for both
    if settings.length_buckets is not None:  # the step's arguments: the function's but opt_state
        step.inner_step = InnerStep(grad_step, lambda arguments: (arguments[0], *arguments[2:]))
    step.unsplit = unsplit_step(fn, tx, has_aux, update)
    step.parity_groups = (("loss", "aux") if has_aux else "loss", "params", "opt_state")
    return step


def unsplit_step(fn, tx, has_aux, update: Update) -> Callable:
    """The one-plan step unsplit: `jax.value_and_grad`, the clip and `tx` on the whole tree."""

    def step(params, opt_state, *args):
        value, grads = jax.value_and_grad(fn, has_aux=has_aux)(params, *args)
        if update.max_grad_norm is not None:
            grads, _ = optax.clip_by_global_norm(update.max_grad_norm).update(grads, optax.EmptyState())
        extra = update_arguments("unsplit", tx, value if has_aux else (value, None), update.update_kwargs)
        updates, new_state = tx.update(grads, opt_state, params, **extra)
        new_params = optax.apply_updates(params, updates)
        if update.skip_nonfinite:
            finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_params, new_state = (
                jax.tree.map(keep, new_params, params),
                jax.tree.map(keep, new_state, opt_state),
            )
        return value, new_params, new_state

    return step


def update_arguments(name: str, tx, value, update_kwargs) -> dict:
    """`tx.update`'s keyword arguments: `value=loss` for a transformation taking extra arguments,
    then `update_kwargs(loss, aux)`."""
    loss, aux = value
    extra = {"value": loss} if isinstance(tx, optax.GradientTransformationExtraArgs) else {}
    if update_kwargs is not None:
        more = update_kwargs(loss, aux)
        if not isinstance(more, dict):
            raise MpmdError(
                f"{name}: update_kwargs(loss, aux) must return a dict, got {type(more).__name__}."
            )
        extra.update(more)
    return extra


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
