"""Orbax's calls that write or wait for a save, watched.

A failed save's temporary folder is removed before its error propagates
(`removing_partial_steps`). In a multi-process job, orbax's barriers wait for
the other processes; one that died is noticed there only when JAX's heartbeat
stops (twice the timeout, a minute by default), and the survivor then ends in
orbax's timeout or JAX's abort, neither of which says a save was interrupted.
So from a save until it is committed, a process that ends without finishing
ends this one at once with a `CheckpointError` naming it and the step
(`spectrax_mpmd._comm.Peers` sees a peer's end within milliseconds).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import jax

from .._comm import RENDEZVOUS_TIMEOUT, Peers
from .._env import configured_timeout
from .hosts import removing_partial_steps
from .orbax_io import settle


class SaveWatch:
    """What one `CheckpointManager` wraps around its orbax manager's writes and waits."""

    def __init__(self, directory: Path, manager):
        self.directory, self.manager = directory, manager
        self.peers: Peers | None = None  # multi-process: made at the first save (collectively)
        self.in_orbax = 0  # orbax calls in progress that may wait for the other processes

    @contextlib.contextmanager
    def orbax_call(self):
        """Around an orbax call that writes or waits for a save."""
        self.in_orbax += 1
        try:
            with removing_partial_steps(self.directory, functools.partial(settle, self.manager)):
                yield
        finally:
            self.in_orbax -= 1

    def saving(self, step: int) -> None:
        """Called by every process as it starts saving `step`: until the step is committed, a peer
        that ends without finishing ends this process (multi-process jobs only)."""
        if jax.process_count() == 1:
            return
        if self.peers is None:
            self.peers = Peers(max(configured_timeout(), RENDEZVOUS_TIMEOUT))
        in_progress = getattr(self.manager, "is_saving_in_progress", lambda: True)
        self.peers.guard(
            lambda: self.in_orbax > 0 or in_progress(),
            functools.partial(_save_lost, jax.process_index(), step, self.directory),
        )


def _save_lost(me: int, step: int, directory: Path, peer: int, how: str) -> str:
    return (
        f"spectrax_mpmd.errors.CheckpointError: process {me}: process {peer} {how} during the "
        f"checkpoint save of step {step} in {directory}; ending this process instead of waiting "
        "for it in orbax's barrier. The step is committed only if every process finished writing "
        "it; a restore reads committed steps only, so the last committed step is intact. Restart "
        "the job and restore it (latest_step())."
    )
