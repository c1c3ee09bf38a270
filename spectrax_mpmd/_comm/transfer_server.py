"""Transports: how a plan step moves buffers from one pipeline rank to another.

One small contract (`send_step`, `recv_step`, `local_step`, `begin`, `end`)
with three implementations:

* `InProcess` — both ranks in this process: the device-to-device copy of
  `_transfer.transfer` (JAX's C++ batched copy or `jax.device_put`).
* `TransferServerTransport` — the ranks in different processes of one
  `jax.distributed` job: one-sided pulls through `jax.experimental.transfer`.
  Each process starts one transfer server; the servers' addresses are
  exchanged through the `jax.distributed` key-value store (`_exchange`) when
  the transport is made. A sender posts `await_pull(uuid, arrays)` right after the
  cell that made them (non-blocking: the server waits for the arrays to be
  ready); the receiver calls `pull(uuid, specs)`, which returns at once with
  arrays that become ready when the bytes arrive. The uuid is the call number
  and the index of the transfer group in the plan, which every process
  computes identically, so any schedule order works without lockstep.
* `PairTransport` (`_pair.py`, chosen with `SPECTRAX_MPMD_TRANSPORT=ppermute`)
  — two-sided `lax.ppermute` programs over one device of each side.

Cross-process `jax.device_put` is not used: on CPU it fails, moves nothing or
hangs. A pull has no working timeout of its own, so `end` (run after every
call) waits for the call's pulls on a helper thread and raises
`TransferTimeoutError` naming the missing transfer (ranks, edge, microbatch)
when they are not all in after `timeout` seconds, or `PeerLostError` when a
pull failed because the peer went away. `CrossProcess` holds what both
cross-process transports share: transfer groups, the deadline and the exit
barrier.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import socket
import sys
import threading
from typing import Callable, Sequence

import jax

from ..errors import DistributedError, PeerLostError, TransferTimeoutError
from .local import transfer

DEFAULT_TIMEOUT = 30.0
RENDEZVOUS_TIMEOUT = 300.0  # seconds a first build or the exit waits for the other processes
TIMEOUT_ENV = "SPECTRAX_MPMD_TIMEOUT"
HOST_ENV = "SPECTRAX_MPMD_TRANSFER_HOST"
TRANSPORT_ENV = "SPECTRAX_MPMD_TRANSPORT"
TRANSPORTS = ("transfer", "ppermute")
_GROUPS_PER_CALL = 1 << 24  # uuid = call * _GROUPS_PER_CALL + group


def configured_timeout() -> float:
    """The transfer timeout in seconds: `$SPECTRAX_MPMD_TIMEOUT`, default 30."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds, e.g. 30.")
    return value


def configured_transport() -> str:
    """The cross-process transport: `$SPECTRAX_MPMD_TRANSPORT`, `"transfer"` (default) or `"ppermute"`."""
    name = os.environ.get(TRANSPORT_ENV, "transfer")
    if name not in TRANSPORTS:
        raise DistributedError(f"{TRANSPORT_ENV}={name!r}: expected one of {', '.join(TRANSPORTS)}.")
    return name


class InProcess:
    """Moves between ranks of this process: the device-to-device copy of single-process plans."""

    @staticmethod
    def local_step(sources: Sequence, targets: Sequence) -> Callable:
        return transfer(sources, targets)


class _Send:
    """Plan step: post this call's transfer group `group` for `peer` to pull; returns nothing."""

    __slots__ = ("transport", "group", "peer")

    def __init__(self, transport, group: int, peer: int):
        self.transport, self.group, self.peer = transport, group, peer

    def __call__(self, *arrays):
        self.transport.server.await_pull(self.transport.uuid(self.group), list(arrays))
        return ()


class _Recv:
    """Plan step: pull this call's transfer group `group` from process `peer`."""

    __slots__ = ("transport", "group", "peer", "specs")

    def __init__(self, transport, group: int, peer: int, specs: list):
        self.transport, self.group, self.peer, self.specs = transport, group, peer, specs

    def __call__(self):
        t = self.transport
        arrays = t.connection(self.peer).pull(t.uuid(self.group), self.specs)
        t.pending.append((self.group, arrays))
        return arrays


def _advertised_host() -> str:
    """The address peers reach this process's transfer server at: `$SPECTRAX_MPMD_TRANSFER_HOST`,
    else the local address of the interface that routes to the coordinator (loopback for a
    loopback coordinator)."""
    host = os.environ.get(HOST_ENV)
    if host:
        return host
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    try:
        from jax._src import distributed  # private: the address the job was initialised with

        coordinator = getattr(distributed.global_state, "coordinator_address", None) or coordinator
    except ImportError:
        pass
    target = coordinator.rsplit(":", 1)[0].strip("[]") if coordinator else ""
    if not target or target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class _Waiter:
    """A daemon thread that blocks on a call's pulls, one group at a time, so the caller can wait
    for them with a deadline (a pull cannot be given a working timeout itself)."""

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

    def wait(self, pending: list, timeout: float):
        """None when every group arrived; `(group, error)` when one failed; raises `queue.Empty`
        (with `self.current` the group still awaited) when `timeout` passes first."""
        done: queue.Queue = queue.Queue()
        self.jobs.put((pending, done))
        return done.get(timeout=timeout)


def _exit_without_shutdown_barrier() -> None:
    """After a lost transfer the job cannot go on: at exit, skip JAX's shutdown barrier (which
    would wait for the lost peer, then abort) and end this process with code 1 at once, so the
    error raised here is what the job reports. Registered after JAX's own exit handler, so it
    runs first."""

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(leave)


class CrossProcess:
    """What the cross-process transports share: transfer groups, the deadline on a call's
    receives, and the exit barrier.

    Made once per compiler (every process makes it at the same point of the same script,
    so the k-th transport of every process is the same exchange). Every process checks
    that the job agrees on the transport.
    """

    name = ""

    def __init__(self, timeout: float | None = None):
        from .exchange import Exchange  # imports this module

        self.timeout = configured_timeout() if timeout is None else float(timeout)
        self.process = jax.process_index()
        # processes reach their first build and their exit at their own pace (tracing, compiling,
        # loading data): these rendezvous wait longer than a transfer; a lost process still ends
        # the job through JAX's heartbeat (twice the timeout, see `initialize`)
        self._exchange = Exchange("transfer", max(self.timeout, RENDEZVOUS_TIMEOUT))
        chosen = self._exchange.allgather(self.name)
        if len(set(chosen)) > 1:
            raise DistributedError(
                f"the processes chose different transports ({', '.join(f'process {p}: {n}' for p, n in enumerate(chosen))}); "
                f"set {TRANSPORT_ENV} the same on every process."
            )
        self.call = 0
        self.pending: list = []
        self.describe: dict[int, tuple[str, int]] = {}  # group -> (what it carries, sender), for errors
        self._waiter: _Waiter | None = None
        atexit.register(self._drain_at_exit)  # runs before JAX's own exit handlers (registered earlier)

    def _drain_at_exit(self) -> None:
        """At exit JAX tears down this process's client (and a transfer server with it) while a
        peer may still be receiving this process's last sends (a process that receives nothing
        does not wait for them). Wait until every process has finished its steps: then every
        transfer has arrived."""
        try:
            self._exchange.allgather("exit")
        except Exception as err:  # noqa: BLE001 - at exit: report, do not mask the exit status
            logging.getLogger("spectrax_mpmd").error("%s", err)

    def new_group(self, what: str, sender: int) -> int:
        """A transfer-group id for a plan being built (the same on every process: plans are built in
        the same order everywhere), remembered with what it carries for error messages."""
        group = len(self.describe)
        self.describe[group] = (what, sender)
        return group

    local_step = staticmethod(InProcess.local_step)

    def begin(self) -> None:
        """Start a call: its transfers get uuids of their own."""
        self.call += 1
        self.pending = []

    def end(self) -> None:
        """Wait, up to the timeout, for every receive of this call; raise naming the one missing."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        if self._waiter is None:
            self._waiter = _Waiter()
        try:
            failed = self._waiter.wait(pending, self.timeout)
        except queue.Empty:
            group = self._waiter.current
            _exit_without_shutdown_barrier()
            raise TransferTimeoutError(
                f"process {self.process}: {self._what(group)} did not arrive within {self.timeout:g} s "
                f"(process {self._sender(group)} may have died or stalled). Raise the limit with "
                f"{TIMEOUT_ENV}=<seconds> (or spectrax_mpmd.initialize(timeout=...)) if a step is that slow."
            ) from None
        if failed is not None:
            group, err = failed
            _exit_without_shutdown_barrier()
            raise PeerLostError(
                f"process {self.process}: {self._what(group)} failed: the sending process "
                f"{self._sender(group)} is gone ({str(err).splitlines()[0]})."
            ) from err

    def _what(self, group) -> str:
        return self.describe.get(group, (f"transfer group {group}", None))[0]

    def _sender(self, group) -> str:
        return str(self.describe.get(group, ("", "?"))[1])


class TransferServerTransport(CrossProcess):
    """Cross-process moves through `jax.experimental.transfer`, one server per process."""

    name = "transfer"

    def __init__(self, timeout: float | None = None):
        from jax.experimental import transfer as jax_transfer

        super().__init__(timeout)
        client = jax.local_devices()[0].client
        host = _advertised_host()
        self.server = jax_transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])
        self.addresses = self._exchange.allgather(self.server.address())
        self.connections: dict[int, object] = {}

    def uuid(self, group: int) -> int:
        return self.call * _GROUPS_PER_CALL + group

    def connection(self, peer: int):
        conn = self.connections.get(peer)
        if conn is None:
            conn = self.connections[peer] = self.server.connect(self.addresses[peer])
        return conn

    def send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _Send:
        return _Send(self, group, peer)

    def recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _Recv:
        return _Recv(self, group, peer, list(specs))


def make_transport() -> CrossProcess:
    """The cross-process transport `$SPECTRAX_MPMD_TRANSPORT` names (the transfer server by default)."""
    if configured_transport() == "ppermute":
        from .ppermute import PairTransport

        return PairTransport()
    return TransferServerTransport()
