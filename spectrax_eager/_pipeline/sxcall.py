"""`spx.sxcall`: `spectrax_mpmd.sxcall` in the form written for `spectrax-lib`, which also takes a
`PipelineSequential` and runs it with `spx.run` (one stage per child)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..nn._containers import PipelineSequential
from .run import no_fusion, run_with


def sxcall(
    stages,
    batch,
    *,
    mesh,
    schedule=None,
    loss_fn: Callable | None = None,
    mode: str = "train",
    has_aux: bool = False,
    transport: str = "device_put",
    donate_activations: bool = False,
    static_argnums=None,
    donate_argnums=None,
    chunks: int | None = None,
    fuse_1f1b: bool = False,
    fuse_zb: bool = False,
) -> Any:
    """`spectrax_mpmd.sxcall` that also takes a `PipelineSequential` (run with `spx.run`, one stage per child).

    Train mode: `batch` is `(inputs, *targets)`, `loss_fn(outputs, *targets)`; returns `(loss,
    grads)` (`(loss, grads, aux)` with `has_aux`), `grads` a `State` of the whole model. Forward
    mode: `batch` is the inputs (or a 1-tuple of them). For code written for `spectrax-lib`,
    `transport="device_put"`, `donate_argnums` (not acted on: donating the batch only saves
    memory) and the unset `donate_activations`, `chunks`, `static_argnums`, `fuse_*` are
    accepted; other values of them are refused.
    """
    import spectrax_mpmd as mp

    settings = mp.StepSettings.of("spx.sxcall", locals())
    no_fusion("spx.sxcall", fuse_1f1b=fuse_1f1b, fuse_zb=fuse_zb)
    unsupported = dict(
        transport=(transport != "device_put", "arrays move between ranks with jax.device_put"),
        donate_activations=(bool(donate_activations), "activations are freed after their last use"),
        chunks=(chunks is not None, "microbatches are the schedule's (GPipe(microbatches=...))"),
        static_argnums=(static_argnums not in (None, ()), "close over static values in loss_fn"),
    )
    for key, (bad, why) in unsupported.items():
        if bad:
            raise mp.MpmdError(f"spx.sxcall: {key}= is not taken here ({why}); leave it unset.")
    if not isinstance(stages, PipelineSequential):
        if has_aux:
            raise mp.MpmdError("spx.sxcall: has_aux=True needs a PipelineSequential (run through spx.run).")
        return mp.sxcall(stages, batch, mesh=mesh, schedule=schedule, loss_fn=loss_fn, mode=mode)
    if mode == "forward":
        inputs = batch[0] if isinstance(batch, tuple) and len(batch) == 1 else batch
        return run_with(stages, inputs, None, settings, None)
    if not (isinstance(batch, tuple) and len(batch) >= 1):
        raise mp.MpmdError("spx.sxcall: with mode='train', batch must be a tuple (inputs, *targets).")
    inputs, targets = batch[0], batch[1:]
    loss = None if loss_fn is None else _spread_targets(loss_fn)
    out = run_with(stages, inputs, targets, settings, loss)
    if has_aux:
        (value, aux), grads = out
        return value, grads, aux
    return out


def _spread_targets(loss_fn: Callable) -> Callable:
    """`loss_fn(outputs, *targets)` as a function of `(outputs, targets)`."""

    def loss(outputs, targets):
        return loss_fn(outputs, *targets)

    return loss
