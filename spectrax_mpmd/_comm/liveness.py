"""Seeing at once when another process of the job ends, and guarding waits inside other libraries.

JAX's coordination service learns that a process died only when its heartbeats
stop (twice the timeout: a minute by default). A process waiting inside a
library's barrier meanwhile (orbax's checkpoint commit) sits until then and ends
in that library's timeout or in JAX's abort, neither of which says what
happened. So each process here keeps a TCP connection to every other one: the
operating system closes a process's connections when it ends, however it ends,
so a peer's end is seen within milliseconds. A process that ends normally says
so first; any other end counts as a failure. While a guard holds (`guard`), a
failed peer ends this process at once with the guard's error.
"""

from __future__ import annotations

import atexit
import contextlib
import selectors
import socket
import sys
import threading
from collections.abc import Callable

import jax

from .deadline import ending_by_error, leave
from .exchange import Exchange
from .transfer_server import _advertised_host

_BYE = b"bye"  # what a process sends its peers when it ends normally


class Peers:
    """This process's connections to every other process of the job (made collectively: every
    process makes its `Peers` at the same point of the same script)."""

    def __init__(self, timeout: float):
        self.me, self.world = jax.process_index(), jax.process_count()
        self.server = socket.create_server((_advertised_host(), 0))
        host, port = self.server.getsockname()[:2]
        addresses = Exchange("liveness", timeout).allgather(f"{host}:{port}")
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, name="spectrax-mpmd-peers-accept", daemon=True).start()
        self.selector = selectors.DefaultSelector()
        for p, address in enumerate(addresses):
            if p != self.me:
                host, _, port = address.rpartition(":")
                self.selector.register(
                    socket.create_connection((host, int(port)), timeout), selectors.EVENT_READ, p
                )
        self.said: dict[int, bytes] = {}
        self.failed: dict[int, str] = {}  # process -> how it ended
        self.guard_set: tuple[Callable[[], bool], Callable[[int, str], str]] | None = None
        threading.Thread(target=self._watch, name="spectrax-mpmd-peers", daemon=True).start()
        atexit.register(self._goodbye)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def _goodbye(self) -> None:
        """At exit: a process ending normally tells its peers so (ending by an uncaught error, it
        does not: they see a failure)."""
        if ending_by_error():
            return
        for conn in self.accepted:
            with contextlib.suppress(OSError):
                conn.sendall(_BYE)

    def _watch(self) -> None:
        while True:
            for key, _ in self.selector.select():
                peer, conn = key.data, key.fileobj
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                self.said[peer] = self.said.get(peer, b"") + data
                if data:
                    continue
                self.selector.unregister(conn)
                if self.said[peer] != _BYE:
                    self._lost(peer, "ended without finishing (killed, crashed, or ended by an error)")

    def _lost(self, peer: int, how: str) -> None:
        self.failed[peer] = how
        guard = self.guard_set
        if guard is not None and guard[0]():
            sys.stderr.write(guard[1](peer, how) + "\n")
            leave(1)

    def guard(self, active: Callable[[], bool], message: Callable[[int, str], str]) -> None:
        """From now on, while `active()` holds, a failed peer ends this process with code 1 after
        writing `message(peer, how)` (a peer that failed before is reported at once)."""
        self.guard_set = (active, message)
        for peer, how in list(self.failed.items()):
            self._lost(peer, how)
