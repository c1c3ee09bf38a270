"""How pipeline ranks talk.

    base             the `Transport` contract; `CrossProcess`, what the cross-process transports share
    local            copies between ranks of one process (JAX's C++ batched copy or `jax.device_put`)
    reshard          a layout change between sharded placements, shard to shard (for `local`, `wire`)
    wire             the layout a cross-process move travels in when the two ranks cut the value differently
    exchange         small all-gathers of strings through the `jax.distributed` key-value store
    transfer_server  cross-process moves as one-sided pulls (`jax.experimental.transfer`), the default
    ppermute         cross-process moves as two-sided `lax.ppermute` programs
    deadline         bounded waits: a call's receives, an issue that blocks, leaving a failed job
    distributed      joining a `jax.distributed` job (`initialize`, `check_joined`)
    liveness         a connection to every other process: a peer's end seen at once (`Peers`)

Modules import one way: `reshard`, `exchange` and `deadline` import no sibling;
`distributed` imports `deadline`; `local` imports `reshard`; `wire` imports `local`
and `reshard`; `base` imports `exchange`, `deadline`, `local` and `wire`; the two
transports import `base`; `liveness` imports `deadline`, `exchange` and
`transfer_server` (the address peers reach this process at).
"""

from __future__ import annotations

from .._env import configured_transport
from .base import RENDEZVOUS_TIMEOUT, CrossProcess, Transport
from .deadline import exit_without_shutdown_barrier
from .distributed import check_joined, claim_path, initialize
from .exchange import Exchange
from .liveness import Peers
from .local import fast_path_available, is_transfer, same_layout, transfer
from .ppermute import PairTransport
from .transfer_server import TransferServerTransport

__all__ = [
    "RENDEZVOUS_TIMEOUT",
    "CrossProcess",
    "Exchange",
    "PairTransport",
    "Peers",
    "TransferServerTransport",
    "Transport",
    "check_joined",
    "claim_path",
    "exit_without_shutdown_barrier",
    "fast_path_available",
    "initialize",
    "is_transfer",
    "make_transport",
    "same_layout",
    "transfer",
]


def make_transport() -> CrossProcess:
    """The cross-process transport `$SPECTRAX_MPMD_TRANSPORT` names (the transfer server by default)."""
    if configured_transport() == "ppermute":
        return PairTransport()
    return TransferServerTransport()
