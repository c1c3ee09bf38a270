"""An optimizer update gated by a global condition, synchronous or validated after the fact.

Global-norm clipping and skipping a step whose gradients are not finite both
depend on every rank's gradients. `guarded_update` writes either form as
ordinary JAX, which the train step splits by ownership:

* `"sync"`: the update waits for the global norm, then runs with the gradients
  clipped (as `optax.clip_by_global_norm`) and is dropped when they are not finite;
* `"post"`: each rank updates speculatively with its raw gradients right after
  its backward; when the global norm arrives, a `lax.cond` per rank keeps that
  update, or recomputes it clipped (or drops it) in the rare step where the
  condition triggers. The results equal the synchronous form's; only the
  triggered steps pay the update twice, and until then the old parameters and
  state stay alive next to the new ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from spectrax_core import schedules as S

# the values a step can be given: the core's, less "none", which is what either is when there is
# neither a clip nor a non-finite skip (the update then reads no other rank's gradients)
VALIDATIONS = tuple(v for v in S.VALIDATIONS if v != "none")


def _clipped(grads, norm, max_norm):
    """`optax.clip_by_global_norm`'s arithmetic: unchanged below `max_norm`, else rescaled."""
    if max_norm is None:
        return grads
    keep = norm < max_norm
    return jax.tree.map(lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), grads)


def _apply(tx, params, state, grads, extra: dict):
    updates, state = tx.update(grads, state, params, **extra)
    return optax.apply_updates(params, updates), state


def guarded_update(
    tx,
    params,
    state,
    grads,
    *,
    max_grad_norm,
    skip_nonfinite: bool,
    validation: str,
    extra: dict | None = None,
):
    """`(new_params, new_state)`: `tx` on `grads` clipped to `max_grad_norm` (None: no clipping),
    the step dropped when `skip_nonfinite` and the gradients are not finite; `extra` are keyword
    arguments of `tx.update` (`value=` for `optax.contrib.reduce_on_plateau`)."""
    extra = extra or {}
    if max_grad_norm is None and not skip_nonfinite:
        return _apply(tx, params, state, grads, extra)
    norm = optax.tree.norm(grads)
    finite = jnp.isfinite(norm) if skip_nonfinite else jnp.bool_(True)

    def exact():
        new_params, new_state = _apply(tx, params, state, _clipped(grads, norm, max_grad_norm), extra)
        if not skip_nonfinite:
            return new_params, new_state
        return jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), (new_params, new_state), (params, state)
        )

    if validation == "sync":
        return exact()
    speculative = _apply(tx, params, state, grads, extra)
    triggered = ~finite
    if max_grad_norm is not None:
        triggered = triggered | (norm >= max_grad_norm)
    return jax.lax.cond(triggered, exact, lambda: speculative)
