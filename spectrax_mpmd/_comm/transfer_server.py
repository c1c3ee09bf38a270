"""The transfer-server transport: cross-process moves as one-sided pulls through
`jax.experimental.transfer`.

Each process starts one transfer server; the servers' addresses are exchanged
through the `jax.distributed` key-value store (`exchange`) when the transport is
made. A sender posts `await_pull(uuid, arrays)` right after the cell that made
them (non-blocking: the server waits for the arrays to be ready); the receiver
calls `pull(uuid, specs)`, which returns at once with arrays that become ready
when the bytes arrive. The uuid is the call number and the index of the
transfer group in the plan, which every process computes identically, so any
schedule order works without lockstep.

Cross-process `jax.device_put` is not used: on CPU it fails, moves nothing or
hangs. A pull has no working timeout of its own; `CrossProcess.end` bounds the
wait.
"""

from __future__ import annotations

import socket
from typing import Sequence

import jax

from .._env import coordinator_from_env, transfer_host
from .._trace.jax_private import private
from .base import CrossProcess

_GROUPS_PER_CALL = 1 << 24  # uuid = call * _GROUPS_PER_CALL + group


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
    host = transfer_host()
    if host:
        return host
    coordinator = coordinator_from_env() or ""
    state = private("jax._src.distributed.global_state")  # the address the job was initialised with
    coordinator = getattr(state, "coordinator_address", None) or coordinator
    target = coordinator.rsplit(":", 1)[0].strip("[]") if coordinator else ""
    if not target or target in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))  # no packet is sent: this only picks the outgoing interface
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


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

    def open_channels(self) -> None:
        for peer in sorted(self.senders):
            self.connection(peer)

    def _send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _Send:
        return _Send(self, group, peer)

    def _recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _Recv:
        return _Recv(self, group, peer, list(specs))
