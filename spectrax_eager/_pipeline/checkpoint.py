"""Checkpoints of eager models and optimizers: their exported `State`s through orbax.

`save_checkpoint` writes `spx.export(model)`'s State (and the optimizer's, an
`spx.Optimizer` being a Module too) with `spectrax_mpmd`'s orbax checkpoints;
`restore_checkpoint` reads a step back into live modules, each value onto the
devices its variable holds now, so a restored model equals the saved one.
Needs the `checkpoint` extra (orbax-checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .._graph.export import export, update
from .._graph.module import Module


def _require(obj: Any, what: str) -> Module:
    if not isinstance(obj, Module):
        raise TypeError(f"{what} must be an spx.Module, received {type(obj).__name__}.")
    return obj


def save_checkpoint(
    directory: str | os.PathLike, step: int, model: Module, optimizer: Module | None = None, *, extra=None
) -> Path:
    """Save `model`'s variables (and `optimizer`'s state) as `step` in `directory`; returns the step's folder.

    `directory` may also be an `spectrax_mpmd.CheckpointManager` (numbered
    steps, `max_to_keep`, asynchronous saves). `extra` is JSON (a data
    position, a seed). Every array is written from the devices that hold it.
    """
    import spectrax_mpmd as mp

    params = export(_require(model, "save_checkpoint: model"))[1]
    opt_state = None if optimizer is None else export(_require(optimizer, "save_checkpoint: optimizer"))[1]
    if isinstance(directory, mp.CheckpointManager):
        directory.save(step, params=params, opt_state=opt_state, extra=extra, force=True)
        return directory.directory / str(step)
    return mp.save_checkpoint(directory, step, params=params, opt_state=opt_state, extra=extra)


def restore_checkpoint(
    directory: str | os.PathLike, step: int | None = None, *, model: Module, optimizer: Module | None = None
):
    """Read `step` (default: the latest) into `model` (and `optimizer`) in place.

    The modules must have the saved structure (build them as for the saved
    run); a differing variable is named in the error. Returns
    `spectrax_mpmd.Restored(step, params, opt_state, extra)`.
    """
    import spectrax_mpmd as mp

    like = export(_require(model, "restore_checkpoint: model"))[1]
    opt_like = None if optimizer is None else export(_require(optimizer, "restore_checkpoint: optimizer"))[1]
    if isinstance(directory, mp.CheckpointManager):
        restored = directory.restore(step, like=like, opt_like=opt_like)
    else:
        restored = mp.restore_checkpoint(directory, step, like=like, opt_like=opt_like)
    update(model, restored.params)
    if optimizer is not None:
        update(optimizer, restored.opt_state)
    return restored
