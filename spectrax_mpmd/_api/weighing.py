"""A training step's loss as the stages compute it, and how its microbatches weigh
(`spectrax_mpmd._trace.weights`), from the step's settings."""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from .._trace.args import Signature
from .._trace.exact_loss import BATCH, PARAM
from .._trace.split import trace
from .._trace.weights import loss_weights
from ..errors import MpmdError


def with_aux(fn: Callable, has_aux: bool) -> Callable:
    """`fn` returning `(loss, aux)`: its own pair with `has_aux`, else `(loss, None)`."""

    def wrapped(*args):
        out = fn(*args)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise MpmdError("has_aux=True: the function must return a pair (loss, aux).")
            return out
        return out, None

    return wrapped


def step_weights(step, sig: Signature, kinds, micro: list, closed, whole: Callable, m: int) -> tuple:
    """`(loss jaxpr, LossWeights)` of `step` (a `sxvalue_and_grad` step) for this signature:
    `closed` is its loss traced on `micro` (the microbatch's avals), `whole()` on the whole
    batch (traced when first needed), `m` microbatches."""
    roles = {a: PARAM for a in kinds.params} | {a: BATCH for a in kinds.batch}
    weight, settings = None, step.settings
    if settings.microbatch_weight_fn is not None:
        weight = trace(sig.bind(settings.microbatch_weight_fn), sig.in_tree.unflatten(micro))[0]

    return loss_weights(
        step.name,
        closed,
        roles,
        reduce=settings.reduce,
        weight_fn=weight,
        whole=whole,
        m=m,
        keys=kinds.keys,
        exact=step.exact,
    )


def check_loss(name: str, closed) -> None:
    """Refuse a traced loss that is not a floating-point scalar."""
    loss_aval = closed.out_avals[0]
    if loss_aval.shape != () or not jax.dtypes.issubdtype(loss_aval.dtype, np.inexact):
        raise MpmdError(
            f"{name}: the loss must be a floating-point scalar, got {loss_aval.str_short()}; "
            "reduce it (e.g. mean over the batch) before returning."
        )
