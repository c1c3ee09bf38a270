"""How checkpoints drive orbax: its import, the manager with its options and handlers, waiting
out a failed save's background work, and what a failed read names."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import jax

from .hosts import remove_uncommitted
from .layout import CheckpointError

_SETTLE_TRIES = 16  # more than the errors one failed save can leave stored (see `settle`)


def load_orbax():
    """`orbax.checkpoint`, or a `CheckpointError` saying how to install it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise CheckpointError(
            "checkpoints need orbax-checkpoint, which is not installed; install the checkpoint extra: "
            "pip install 'spectrax-mpmd[checkpoint]' (or pip install orbax-checkpoint)."
        ) from err
    return ocp


def open_manager(ocp, directory: Path, items, max_to_keep, save_interval_steps: int, async_save, create):
    """orbax's `CheckpointManager` over `directory` for `items` (`params`, `opt_state`: pytrees of
    arrays; the rest JSON). In a multi-process run every process is active, so that orbax's
    barriers go through the key-value store rather than a device collective (docs/multihost.md)."""
    world = jax.process_count()
    if create and world > 1:  # orbax leaves creating the directory to us with active_processes
        directory.mkdir(parents=True, exist_ok=True)
    # a save killed midway left its folder: removed now, before anything runs (orbax's own
    # `cleanup_tmp_directories` removes it in the background, awaited only by a save)
    remove_uncommitted(directory)
    processes = ocp.options.MultiprocessingOptions(active_processes=set(range(world)) if world > 1 else None)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=save_interval_steps,
        enable_async_checkpointing=async_save,
        create=create and world == 1,
        # the step folder made before `save` returns, not by a background task that a failed save
        # would leave running (and that could re-create the folder after its removal)
        async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        multiprocessing_options=processes,
    )
    # jax.Array without replica-parallel writing: replica 0 (an array's owner, see `hosts`)
    # writes each array whole
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
    handlers = {
        item: ocp.PyTreeCheckpointHandler(
            multiprocessing_options=processes,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, arrays)),
        )
        for item in ("params", "opt_state")
    }
    return ocp.CheckpointManager(directory, options=options, item_names=items, item_handlers=handlers)


def settle(manager) -> None:
    """Let orbax's background work end after a failed save: its save thread, then its queued
    metadata writes. orbax raises a stored error (or a failed write's) once per call, so the call
    is repeated until one returns; each raise consumes what it reports."""
    with contextlib.suppress(Exception):
        manager.wait_until_finished()
    for _ in range(_SETTLE_TRIES):
        try:
            manager.check_for_errors()
            return
        except Exception:  # noqa: BLE001 - the save's own failure, already being raised
            continue


_OCDBT_READ = re.compile(r'Error reading "([^"]+)/[^"/]*" in OCDBT database at [^"]*"([^"]*)": (.*)')


def read_failure(err: BaseException) -> str:
    """What orbax could not read: the item and array with TensorStore's reason, else the first line."""
    cause: BaseException | None = err
    while cause is not None:
        found = _OCDBT_READ.search(str(cause))
        if found:
            name, database, reason = found.groups()
            return f"{Path(database).name} array {name!r}: {reason.strip()}"
        cause = cause.__cause__ or cause.__context__
    first = str(err).split(" See full TensorStore details", 1)[0].splitlines()
    return f"{type(err).__name__}: {first[0] if first else ''}"
