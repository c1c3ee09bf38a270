"""The layout a value travels in between two processes whose ranks cut it differently.

The cross-process transports move an array shard by shard: the sender's i-th shard
lands on the receiver's i-th device, so both sides must partition the array the same
way over the same number of devices. Pipeline ranks of different sizes or axes cut a
value differently (split over 2 devices on the sender, over 4 on the receiver). Such a
move travels in a *wire* layout both sides can hold: the partition of the side with
fewer devices (the receiver's when both have as many), laid out congruently on the
first devices of the other side. The sender reshards its value into its wire layout
(`reshard`, shard to shard, inside its process), the transport moves those shards,
and the receiver reshards what arrives into the layout it needs. Neither side gathers
a value split on both sides onto one device.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh, NamedSharding, Sharding, SingleDeviceSharding

from ..errors import DistributedError
from .local import trimmed_spec
from .reshard import reshard


def _devices(sharding: Sharding) -> list:
    """The devices of `sharding` in the order its partition is laid out on them."""
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)


def congruent(sharding: Sharding, devices: list) -> Sharding:
    """`sharding`'s partition of an array laid out on the first devices of `devices` instead."""
    if len(sharding.device_set) == 1:
        return SingleDeviceSharding(devices[0], memory_kind=sharding.memory_kind)
    if not isinstance(sharding, NamedSharding):
        raise DistributedError(
            f"a cross-process move between ranks that cut a value differently needs NamedShardings "
            f"(or one device); got {sharding!r}. Give the stage boundary a PartitionSpec "
            "(mp.sxstage_iter(x, sharding=P(...)))."
        )
    mesh = sharding.mesh
    grid = np.asarray(devices[: mesh.devices.size], dtype=object).reshape(mesh.devices.shape)
    return NamedSharding(Mesh(grid, mesh.axis_names), sharding.spec, memory_kind=sharding.memory_kind)


def _same_cut(src: Sharding, dst: Sharding) -> bool:
    """Whether the transports move `src` to `dst` as they are: one device each, or the same spec
    over meshes of the same shape."""
    if len(src.device_set) == 1 and len(dst.device_set) == 1:
        return True
    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
        return False
    return (
        tuple(src.mesh.shape.items()) == tuple(dst.mesh.shape.items())
        and trimmed_spec(src) == trimmed_spec(dst)
        and src.memory_kind == dst.memory_kind
    )


def wire(src: Sharding, dst: Sharding) -> tuple[Sharding, Sharding]:
    """The layouts `(on the sender, on the receiver)` a value laid out as `src` travels in to a
    receiver that needs `dst`: `(src, dst)` when they are cut alike, else one partition on both."""
    if _same_cut(src, dst):
        return src, dst
    if len(src.device_set) < len(dst.device_set):
        return src, congruent(src, _devices(dst))
    return congruent(dst, _devices(src)), dst


class SendInWire:
    """Plan step: reshard the arrays whose layout differs from their wire layout, then send."""

    __slots__ = ("send", "layouts")

    def __init__(self, send, layouts: list):
        self.send, self.layouts = send, layouts  # per array: its wire sharding, or None if it is one

    def __call__(self, *arrays):
        return self.send(*[x if w is None else reshard(x, w) for x, w in zip(arrays, self.layouts)])


class RecvInWire:
    """Plan step: receive in the wire layouts, then reshard into the layouts the receiver needs."""

    __slots__ = ("recv", "layouts")

    def __init__(self, recv, layouts: list):
        self.recv, self.layouts = recv, layouts  # per array: its target sharding, or None if it arrives so

    def __call__(self):
        return [x if t is None else reshard(x, t) for x, t in zip(self.recv(), self.layouts)]
