"""Bounded waits of the cross-process transports, and leaving a job that cannot go on.

A pull of the transfer server has no working timeout of its own, and a
two-sided `ppermute` program blocks the thread that issues it (on CPU) until
the peer issues its side; no Python exception reaches a thread blocked inside
XLA. So a call's receives are awaited on a helper thread (`Waiter`), and a
blocked issue is watched by another (`Watchdog`), which reports the missing
transfer and ends the process when the limit passes.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time

import jax


def leave(code: int) -> None:
    """End this process with `code` at once: no exit handlers, no shutdown barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_without_shutdown_barrier() -> None:
    """After a lost transfer the job cannot go on: at exit, skip JAX's shutdown barrier (which
    would wait for the lost peer, then abort) and end this process with code 1 at once, so the
    error raised here is what the job reports. Registered after JAX's own exit handler, so it
    runs first."""
    atexit.register(leave, 1)


def ending_by_error() -> bool:
    """Whether, at exit, the interpreter is ending because of an uncaught exception (it then
    keeps it as `sys.last_value`)."""
    return getattr(sys, "last_value", None) is not None


class Waiter:
    """A daemon thread that blocks on a call's pulls, one group at a time, so the caller can wait
    for them with a deadline."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.current = None
        threading.Thread(target=self._loop, name="spectrax-mpmd-transfers", daemon=True).start()

    def _loop(self) -> None:
        while True:
            pending, done = self.jobs.get()
            error = None
            for group, arrays in pending:
                self.current = group
                try:
                    jax.block_until_ready(arrays)
                except Exception as err:  # noqa: BLE001 - handed to the caller with its group
                    error = (group, err)
                    break
            self.current = None
            done.put(error)

    def wait(self, pending: list, timeout: float | None):
        """None when every group arrived; `(group, error)` when one failed; raises `queue.Empty`
        (with `self.current` the group still awaited) when `timeout` passes first (None: never)."""
        done: queue.Queue = queue.Queue()
        self.jobs.put((pending, done))
        return done.get(timeout=timeout)


class Watchdog:
    """A daemon thread that ends the process when issuing one step blocks past its limit.

    The issuing thread calls `start(limit, message)` before a step that may block and `stop()`
    after it (two attribute writes); every quarter of the limit (at most a second) the watchdog
    looks, and when the same step has been issuing for longer than `limit` seconds it writes
    `message` as a `TransferTimeoutError` and ends the process with code 1.
    """

    def __init__(self):
        self.step: tuple | None = None  # (started, limit, message) while a step is being issued
        threading.Thread(target=self._loop, name="spectrax-mpmd-watchdog", daemon=True).start()

    def start(self, limit: float, message) -> None:
        """`message`: a callable giving the error text, called only if the limit passes."""
        self.step = (time.monotonic(), limit, message)

    def stop(self) -> None:
        self.step = None

    def _loop(self) -> None:
        while True:
            step = self.step
            time.sleep(min(1.0, step[1] / 4) if step is not None else 0.25)
            if step is not None and self.step is step and time.monotonic() - step[0] > step[1]:
                sys.stderr.write(f"spectrax_mpmd.errors.TransferTimeoutError: {step[2]()}\n")
                leave(1)
