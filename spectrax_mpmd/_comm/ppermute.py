"""The `ppermute` transport: each cross-process move is a two-sided program over one
device of each side.

A transfer group (the arrays one process sends another at one plan step) runs as
one jitted `shard_map` per (sending device, receiving device) pair: a
`lax.ppermute` from the first device of a two-device mesh to the second. Both
processes issue the same program: the sender with its arrays, the receiver with
placeholders of the same shapes (made once per program), and the receiver keeps what
arrives. On accelerators this lowers to the collective library (NCCL); on CPU to
gloo.

Unlike the one-sided transfer server, a collective runs only when both sides
have issued it, in the same order on each device. Every process issues its
steps in the order of the full plan (`_plan.localize` keeps that order), so
the first unfinished collective of the plan always has both sides issued and
its inputs made: the steps cannot deadlock.

An array held on several devices moves shard by shard: the i-th shard of the
sender goes to the i-th device of the receiver, one pair program per device
pair. Both sides cut it alike: where their ranks cut it differently, the move
travels in a layout both hold (`wire`, applied by `CrossProcess`). Nothing is
gathered on one device.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import DistributedError
from .base import CrossProcess


def _pairs(src, dst, shape) -> list:
    """`(sending device, receiving device)` for each shard of an array of `shape`
    laid out as `src` on the sender and `dst` on the receiver: the two cut it alike (the layouts a
    move travels in, see `wire`), so the i-th shard of one is the i-th of the other."""
    sent, got = list(src.devices_indices_map(shape).items()), list(dst.devices_indices_map(shape).items())
    if [index for _, index in sent] != [index for _, index in got]:
        raise DistributedError(
            f"ppermute: a move of shape {shape} from {src} to {dst} needs both sides cut alike; "
            "this is a bug of the cross-process layout choice."
        )
    return [(a, b) for (a, _), (b, _) in zip(sent, got)]


def _shift(*xs):
    return tuple(jax.lax.ppermute(x, "pair", [(0, 1)]) for x in xs)


class _PairProgram:
    """One `ppermute` program moving a few arrays from device `src` to device `dst`.

    Each side passes its local arrays as the one shard on its device of a global array
    declared replicated over the pair; inside the program each device holds its own
    (unequal) shard, and after the permute the receiver's shard is the sender's data.
    """

    def __init__(self, src, dst, avals: Sequence):
        mesh = Mesh(np.array([src, dst]), ("pair",))
        self.src, self.dst = src, dst
        self.global_sharding = NamedSharding(mesh, PartitionSpec())
        self.avals = list(avals)
        spec = PartitionSpec()
        body = jax.shard_map(
            _shift, mesh=mesh, in_specs=(spec,) * len(avals), out_specs=(spec,) * len(avals), check_vma=False
        )
        self.program = (
            jax.jit(body)
            .lower(
                *[
                    jax.ShapeDtypeStruct(shape, dtype, sharding=self.global_sharding)
                    for shape, dtype in self.avals
                ]
            )
            .compile()
        )
        self._placeholders = None

    def _globals(self, locals_: Sequence) -> list:
        return [
            jax.make_array_from_single_device_arrays(shape, self.global_sharding, [x], dtype=dtype)
            for (shape, dtype), x in zip(self.avals, locals_)
        ]

    def send(self, arrays: Sequence) -> None:
        self.program(*self._globals(arrays))

    def receive(self) -> list:
        if self._placeholders is None:
            self._placeholders = [jnp.zeros(shape, dtype, device=self.dst) for shape, dtype in self.avals]
        return [out.addressable_data(0) for out in self.program(*self._globals(self._placeholders))]


def _shard_on(x, device):
    """The shard of `x` held on `device`."""
    for shard in x.addressable_shards:
        if shard.device == device:
            return shard.data
    raise DistributedError(f"ppermute: the array to send has no shard on {device}.")


class _PairSend:
    """Plan step: issue the sending side of a group's programs; returns nothing."""

    __slots__ = ("transport", "group", "peer", "programs")

    def __init__(self, transport, group: int, peer: int, programs):
        self.transport, self.group, self.peer, self.programs = transport, group, peer, programs

    def __call__(self, *arrays):
        self.transport.watch(self.group, self.peer)  # the issue blocks until the peer issues its side
        for program, idx in self.programs:
            program.send([_shard_on(arrays[k], program.src) for k in idx])
        self.transport.unwatch()
        return ()


class _PairRecv:
    """Plan step: issue the receiving side of a group's programs; returns the arrived arrays."""

    __slots__ = ("transport", "group", "peer", "programs", "specs")

    def __init__(self, transport, group: int, peer: int, programs, specs: list):
        self.transport, self.group, self.peer = transport, group, peer
        self.programs, self.specs = programs, specs

    def __call__(self):
        pieces: list = [{} for _ in self.specs]  # per array: {device: its arrived shard}
        self.transport.watch(self.group, self.peer)
        for program, idx in self.programs:
            for k, x in zip(idx, program.receive()):
                pieces[k][program.dst] = x
        self.transport.unwatch()
        out = [
            jax.make_array_from_single_device_arrays(
                spec.shape,
                spec.sharding,
                [got[d] for d in spec.sharding.addressable_devices_indices_map(spec.shape)],
                dtype=spec.dtype,
            )
            for spec, got in zip(self.specs, pieces)
        ]
        self.transport.pending.append((self.group, out))
        return out


class PairTransport(CrossProcess):
    """Cross-process moves as two-sided `ppermute` programs (`SPECTRAX_MPMD_TRANSPORT=ppermute`)."""

    name = "ppermute"

    def __init__(self, timeout: float | None = None):
        super().__init__(timeout)
        self._compiled: dict = {}  # (src, dst, avals) -> _PairProgram: groups of one shape share one

    def _programs(self, sources: Sequence, specs: Sequence) -> list[tuple[_PairProgram, list[int]]]:
        """One program per (sending device, receiving device) pair of a group, with the
        positions of the arrays whose shard it moves: every shard goes from the device
        that holds it to the one that keeps it, nothing is gathered."""
        by_pair: dict = {}
        for k, (src, spec) in enumerate(zip(sources, specs)):
            for pair in _pairs(src, spec.sharding, tuple(spec.shape)):
                by_pair.setdefault(pair, []).append(k)
        programs = []
        for (src, dst), idx in by_pair.items():
            avals = tuple(
                (specs[k].sharding.shard_shape(tuple(specs[k].shape)), jnp.dtype(specs[k].dtype)) for k in idx
            )
            key = (src, dst, avals)
            if key not in self._compiled:
                self._compiled[key] = _PairProgram(src, dst, avals)
            programs.append((self._compiled[key], idx))
        return programs

    def _send_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _PairSend:
        return _PairSend(self, group, peer, self._programs(sources, specs))

    def _recv_step(self, group: int, peer: int, sources: Sequence, specs: Sequence) -> _PairRecv:
        return _PairRecv(self, group, peer, self._programs(sources, specs), list(specs))
