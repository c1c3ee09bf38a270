"""The transport contract, and what the cross-process transports share.

A plan moves a buffer from one pipeline rank to another with a step made by its
transport. Every transport keeps one contract (`Transport`); a single-process
plan needs only its in-process copies (`local.transfer`), a multi-process plan
(`_multihost.localize`) all of it:

* while a plan is built, `new_group(what, sender)` numbers each cross-process
  transfer group (the arrays one process sends another at one plan step; every
  process numbers them identically, since plans are built in the same order),
  `local_step` makes the copy between two ranks of this process, and
  `send_step` / `recv_step` make the two halves of a group's move;
* around each call of a plan, `begin()` starts a call and `end()` waits, up to
  the timeout, for the call's receives, raising `TransferTimeoutError` or
  `PeerLostError` naming the transfer that is missing.

`CrossProcess` implements the shared part: the group numbering, zero-size
arrays (never sent: the receiver makes them), the deadlines on a call's
receives and on an issue that blocks, and the exit barrier. `transfer_server`
and `ppermute` add how a group's bytes travel (`_send_step`, `_recv_step`).
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import numpy as np

from .._env import CHECK_INPUTS_ENV, TIMEOUT_ENV, TRANSPORT_ENV, configured_timeout, configured_watchdog
from ..errors import DistributedError, PeerLostError, TransferTimeoutError
from .deadline import Waiter, Watchdog, ending_by_error, exit_without_shutdown_barrier, leave
from .exchange import Exchange, announce, heard
from .local import transfer
from .wire import RecvInWire, SendInWire, wire

RENDEZVOUS_TIMEOUT = 300.0  # seconds a first build or the exit waits for the other processes
_HEAR_WITHIN = 10.0  # seconds a process that timed out waits to hear what its peer waits for
_HEARD_GONE = 1.0  # seconds it waits to hear what a peer that ended had waited for
_RAISE_LIMIT = (
    f"Raise the limit with {TIMEOUT_ENV}=<seconds> (or spectrax_mpmd.initialize(timeout=...)) if a step "
    "is that slow."
)


class Transport(Protocol):
    """How a plan's steps move buffers between pipeline ranks.

    Steps are callables: a copy or a send takes the arrays it moves as positional
    arguments (a send returns `()`), a receive takes none and returns the arrays
    that arrive; `sources` are the senders' shardings and `specs` the arriving
    arrays' `jax.ShapeDtypeStruct`s with the receiving rank's sharding.
    """

    def local_step(self, sources: Sequence, targets: Sequence) -> Callable:
        """A step copying buffers laid out as `sources` to `targets`, both on this process."""

    def new_group(self, what: str, sender: int) -> int:
        """The id of the next cross-process transfer group; `what` names it in errors."""

    def send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """A step sending transfer group `group` to process `peer`."""

    def recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """A step receiving transfer group `group` from process `peer`."""

    def open_channels(self) -> None:
        """Connect to every process this one receives from, in ascending order (before a plan
        first runs, so that no channel is opened while transfers are in flight)."""

    def begin(self) -> None:
        """Start a call of the plan (before its first step)."""

    def end(self) -> None:
        """Finish a call: wait, up to the timeout, for its receives; raise naming one missing."""


def _holding(specs: Sequence) -> list[int]:
    """The positions of the arrays that hold elements."""
    return [k for k, spec in enumerate(specs) if math.prod(spec.shape)]


def _wired(sources: Sequence, specs: Sequence) -> tuple[list, list]:
    """The senders' shardings and the arriving arrays' specs in the layouts they travel in."""
    pairs = [wire(src, spec.sharding) for src, spec in zip(sources, specs)]
    wired = [jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=b) for spec, (_, b) in zip(specs, pairs)]
    return [a for a, _ in pairs], wired


def _pick(keep: list[int], *lists: Sequence) -> tuple[list, ...]:
    return tuple([items[k] for k in keep] for items in lists)


class _SendSome:
    """Plan step: send only the arrays at `keep` (the others are empty); returns nothing."""

    __slots__ = ("keep", "send")

    def __init__(self, send, keep: list[int]):
        self.send, self.keep = send, keep

    def __call__(self, *arrays):
        if self.send is not None:
            self.send(*[arrays[k] for k in self.keep])
        return ()


class _RecvSome:
    """Plan step: receive the arrays at `keep` and make the empty others on their shardings."""

    __slots__ = ("keep", "recv", "specs")

    def __init__(self, recv, keep: list[int], specs: list):
        self.recv, self.keep, self.specs = recv, set(keep), specs

    def __call__(self):
        arrived = iter(self.recv() if self.recv is not None else ())
        return [
            next(arrived)
            if k in self.keep
            else jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)
            for k, spec in enumerate(self.specs)
        ]


class CrossProcess:
    """What the cross-process transports share: transfer groups, zero-size arrays, the
    deadlines on a call's receives and on a blocked issue, and the exit barrier.

    Made once per compiler (every process makes it at the same point of the same script,
    so the k-th transport of every process is the same exchange). Every process checks
    that the job agrees on the transport.
    """

    name = ""
    local_step = staticmethod(transfer)

    def __init__(self, timeout: float | None = None):
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
        self._waiter: Waiter | None = None
        self._watchdog: Watchdog | None = None
        self._fresh = False  # a plan was built since the last call: its first run waits longer
        self.limit = self.timeout  # the current call's limit on a wait for another process
        self.watchdog = configured_watchdog()  # off: a wait for another process is not bounded
        self.senders: set[int] = set()  # the processes this one receives transfer groups from
        atexit.register(self._drain_at_exit)  # runs before JAX's own exit handlers (registered earlier)

    def _drain_at_exit(self) -> None:
        """At exit JAX tears down this process's client (and a transfer server with it) while a
        peer may still be receiving this process's last sends (a process that receives nothing
        does not wait for them). Wait until every process has finished its steps: then every
        transfer has arrived. A process ending by an uncaught error does not wait, neither here
        nor at JAX's shutdown barrier: the job cannot finish, so it exits with code 1 at once
        and its peers learn of it through their own deadlines (or the launcher stops them)."""
        if ending_by_error():
            leave(1)
        announce("waiting", f"at its exit, after {self.call} calls")
        try:
            self._exchange.allgather("exit")
        except Exception as err:  # noqa: BLE001 - at exit: report, do not mask the exit status
            logging.getLogger("spectrax_mpmd").error("%s", err)

    def new_group(self, what: str, sender: int) -> int:
        """A transfer-group id for a plan being built (the same on every process: plans are built in
        the same order everywhere), remembered with what it carries for error messages."""
        group = len(self.describe)
        self.describe[group] = (what, sender)
        self._fresh = True
        return group

    def send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """Send the group's arrays that hold elements (a zero-size array needs no bytes: its
        receiver makes it)."""
        keep = _holding(specs)
        if len(keep) == len(specs):
            return self._wired_send(group, peer, sources, specs)
        send = self._wired_send(group, peer, *_pick(keep, sources, specs)) if keep else None
        return _SendSome(send, keep)

    def recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """Receive the group's arrays that hold elements; make its zero-size ones here."""
        self.senders.add(int(peer))
        keep = _holding(specs)
        if len(keep) == len(specs):
            return self._wired_recv(group, peer, sources, specs)
        recv = self._wired_recv(group, peer, *_pick(keep, sources, specs)) if keep else None
        return _RecvSome(recv, keep, list(specs))

    def _wired_send(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """The transport's send of the arrays in their wire layouts (`wire`): those the receiving
        rank cuts differently are first resharded here."""
        on_wire, wired = _wired(sources, specs)
        send = self._send_step(group, peer, on_wire, wired)
        layouts = [None if w is s else w for w, s in zip(on_wire, sources)]
        return send if layouts.count(None) == len(layouts) else SendInWire(send, layouts)

    def _wired_recv(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """The transport's receive in the wire layouts, resharded into the receiving rank's."""
        on_wire, wired = _wired(sources, specs)
        recv = self._recv_step(group, peer, on_wire, wired)
        layouts = [None if w.sharding is s.sharding else s.sharding for w, s in zip(wired, specs)]
        return recv if layouts.count(None) == len(layouts) else RecvInWire(recv, layouts)

    def _send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """The transport's send of arrays that all hold elements."""
        raise NotImplementedError

    def _recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> Callable:
        """The transport's receive of arrays that all hold elements."""
        raise NotImplementedError

    def open_channels(self) -> None:
        """Nothing to open by default (a `ppermute` pair is a compiled program of its own)."""

    def begin(self) -> None:
        """Start a call: its transfers get uuids of their own."""
        self.call += 1
        self.pending = []
        # the first run of a new plan waits like a rendezvous: processes compile their own ranks
        self.limit = max(self.timeout, RENDEZVOUS_TIMEOUT) if self._fresh else self.timeout
        self._fresh = False

    def watch(self, group: int, peer: int) -> None:
        """Called before issuing a step of `group` that blocks until process `peer` issues its
        side; past the call's limit the process reports the transfer and ends (`Watchdog`)."""
        if not self.watchdog:
            return
        if self._watchdog is None:
            self._watchdog = Watchdog()
        self._watchdog.start(self.limit, lambda: self._blocked(group, peer))

    def unwatch(self) -> None:
        """Called after the step `watch` announced has been issued."""
        if self._watchdog is not None:
            self._watchdog.stop()

    def _blocked(self, group: int, peer: int) -> str:
        return (
            f"process {self.process}: {self._what(group)} did not arrive within {self.limit:g} s: "
            f"process {peer} did not issue its side of the transfer: {self._peer_state(group, peer)}; "
            f"ending this process. {_RAISE_LIMIT}"
        )

    def _peer_state(self, group: int, peer) -> str:
        """Say what this process waits for (the peers read it), and what `peer` said it waits for:
        a live peer waiting on another transfer means the two run different steps, silence means
        it died or stalled."""
        announce("waiting", f"in its call {self.call} for {self._what(group)}")
        wait = min(self.limit, _HEAR_WITHIN)
        said = heard("waiting", int(peer), wait) if str(peer).isdigit() else None
        if said is None:
            return (
                f"process {peer} said nothing of what it waits for within {wait:g} s more (it may have "
                "died or stalled, or stopped issuing steps after an error or by making fewer calls)"
            )
        return (
            f"process {peer} is alive but waits as well, {said} (this process is in its call "
            f"{self.call}): the processes are not running the same step (different arguments, a "
            "different number of calls, or a call one process skipped); keep "
            f"{CHECK_INPUTS_ENV} on (the default) to have different arguments refused before they run"
        )

    def end(self) -> None:
        """Wait, up to the timeout, for every receive of this call; raise naming the one missing."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        if self._waiter is None:
            self._waiter = Waiter()
        try:
            failed = self._waiter.wait(pending, self.limit if self.watchdog else None)
        except queue.Empty:
            group = self._waiter.current
            exit_without_shutdown_barrier()
            raise TransferTimeoutError(
                f"process {self.process}: {self._what(group)} did not arrive within {self.limit:g} s: "
                f"{self._peer_state(group, self._sender(group))}. {_RAISE_LIMIT}"
            ) from None
        if failed is not None:
            group, err = failed
            exit_without_shutdown_barrier()
            sender = self._sender(group)
            said = heard("waiting", int(sender), _HEARD_GONE) if sender.isdigit() else None
            why = (
                f"; before it ended it had waited in vain {said}: the processes were not running the "
                "same step"
                if said
                else ""
            )
            raise PeerLostError(
                f"process {self.process}: {self._what(group)} failed: the sending process "
                f"{sender} is gone ({str(err).splitlines()[0]}){why}."
            ) from err

    def _what(self, group) -> str:
        return self.describe.get(group, (f"transfer group {group}", None))[0]

    def _sender(self, group) -> str:
        return str(self.describe.get(group, ("", "?"))[1])
