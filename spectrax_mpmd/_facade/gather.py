"""`gather`: every leaf of a tree on one device of this process, across processes too.

In one process this is a `jax.device_put`. In a multi-process run a leaf held
by another process (a global array without local shards, e.g. a parameter that
`StagedOptimizer` updated on its owner) cannot be read here, so every process
calls `gather` with the same tree, at the same point of the script, and each
owner sends its leaves to every other process through the job's cross-process
transport (one transfer group per owner and receiver, every leaf of a group
first copied to one device of its owner). Each process then holds every leaf on
its own device; the call waits, up to the transfer timeout, for what it receives.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import SingleDeviceSharding

from .._comm import make_transport
from ..errors import MpmdError


@functools.cache
def _transport():
    """The cross-process transport gathers use, made on the first multi-process gather (every
    process makes it at the same point of the same script)."""
    return make_transport()


def _owner(x, path: str) -> int:
    owners = {d.process_index for d in x.sharding.device_set}
    if len(owners) != 1:
        raise MpmdError(
            f"gather: leaf {path} is split over the devices of processes {sorted(owners)}; gather reads a "
            "leaf held by one process (a pipeline rank's), as a training step returns them."
        )
    return owners.pop()


def _first_device(process: int) -> jax.Device:
    return min((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def gather(tree, device: jax.Device | None = None):
    """Every leaf of `tree` copied to one device (default: this process's first), e.g. parameters
    spread over ranks. In a multi-process run every process must call it with the same tree (leaves
    of the same shapes); each then holds the whole tree, including the leaves of other processes."""
    device = device if device is not None else jax.local_devices()[0]
    if device.process_index != jax.process_index():
        raise MpmdError(
            f"gather: device {device} belongs to process {device.process_index}, not to this process "
            f"({jax.process_index()}); give one of jax.local_devices(), or None for the first."
        )
    leaves, treedef = jax.tree.flatten_with_path(tree)
    remote = [k for k, (_, x) in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    values = [x for _, x in leaves]
    if remote:
        for k, x in zip(
            remote,
            _exchange([values[k] for k in remote], [jax.tree_util.keystr(leaves[k][0]) for k in remote]),
        ):
            values[k] = x
    return jax.device_put(treedef.unflatten(values), device)


def _exchange(arrays: list, paths: list[str]) -> list:
    """The arrays (each held by one process, every process passing the same list), on this process's
    first device: owners send theirs to every other process, the others receive them."""
    me, world = jax.process_index(), jax.process_count()
    owners = [_owner(x, p) for x, p in zip(arrays, paths)]
    transport = _transport()
    transport.begin()
    out: list = list(arrays)
    for sender in range(world):
        mine = [k for k, o in enumerate(owners) if o == sender]
        if not mine:
            continue
        home = SingleDeviceSharding(_first_device(sender))
        for receiver in range(world):
            if receiver == sender:
                continue
            there = SingleDeviceSharding(_first_device(receiver))
            specs = [jax.ShapeDtypeStruct(arrays[k].shape, arrays[k].dtype, sharding=there) for k in mine]
            group = transport.new_group(f"gather of {len(mine)} leaves (first: {paths[mine[0]]})", sender)
            if me == sender:
                sources = jax.device_put([arrays[k] for k in mine], [home] * len(mine))
                transport.send_step(group, receiver, [home] * len(mine), specs)(*sources)
            elif me == receiver:
                got = transport.recv_step(group, sender, [home] * len(mine), specs)()
                for k, x in zip(mine, got):
                    out[k] = x
    transport.end()
    return out
