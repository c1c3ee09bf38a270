"""`gather`: every leaf of a tree on one device of this process, across processes too.

In one process this is a `jax.device_put`. In a multi-process run a leaf held
by another process (a global array without local shards, e.g. a parameter that
`StagedOptimizer` updated on its owner) cannot be read here, so every process
calls `gather` with the same tree, at the same point of the script, and each
owner sends its leaves to every other process through the job's cross-process
transport (one transfer group per owner and receiver, every leaf of a group
first copied to one device of its owner). Each process then holds every leaf on
its own device; the call returns when every process has what it receives (each wait bounded
by the transfer timeout).
"""

from __future__ import annotations

import functools
import json

import jax
from jax.sharding import SingleDeviceSharding

from .._comm import Exchange, make_transport
from .._mesh import default_device
from .._trace.context import outside_context_mesh
from ..errors import MpmdError


@functools.cache
def _transport():
    """The cross-process transport gathers use and the key-value exchange that ends each gather,
    made on the first multi-process gather (every process makes them at the same point of the
    same script)."""
    return make_transport(), Exchange("gather")


def _first_device(process: int) -> jax.Device:
    return min((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


@outside_context_mesh
def gather(tree, device: jax.Device | None = None):
    """Every leaf of `tree` copied to one device (default: JAX's default device when one is set,
    else this process's first: `spectrax_mpmd._mesh.default_device`), e.g. parameters
    spread over ranks. In a multi-process run every process must call it with the same tree (leaves
    of the same shapes); each then holds the whole tree, including the leaves of other processes."""
    device = device if device is not None else default_device()
    if device.process_index != jax.process_index():
        raise MpmdError(
            f"gather: device {device} belongs to process {device.process_index}, not to this process "
            f"({jax.process_index()}); give one of jax.local_devices(), or None for the default device."
        )
    leaves, treedef = jax.tree.flatten_with_path(tree)
    values = [x for _, x in leaves]
    if jax.process_count() > 1:
        paths = [jax.tree_util.keystr(path) for path, _ in leaves]
        values = exchange(values, paths, range(jax.process_count()))
    return jax.device_put(treedef.unflatten(values), device)


def exchange(arrays: list, paths: list[str], receivers) -> list:
    """`arrays` (every process passing the same list) with each array that some process cannot read
    sent by the one process that holds it to each process of `receivers` lacking it, which gets it on
    its first device; every other array is returned as given."""
    me, world = jax.process_index(), jax.process_count()
    receivers = set(receivers)
    held = [not isinstance(x, jax.Array) or x.is_fully_addressable for x in arrays]
    transport, done = _transport()
    views = [json.loads(v) for v in done.allgather(json.dumps(held))]  # who holds what
    owners = []
    for k, path in enumerate(paths):
        holders = [p for p in range(world) if views[p][k]]
        if len(holders) != 1 and len(holders) != world:
            raise MpmdError(
                f"gather: leaf {path} is held by processes {holders} of {world}; gather reads a leaf held "
                "by one process (a pipeline rank's, as a training step returns them) or by every process."
            )
        owners.append(holders[0] if len(holders) == 1 else None)
    transport.begin()
    out: list = list(arrays)
    for sender in range(world):
        mine = [k for k, o in enumerate(owners) if o == sender]
        if not mine:
            continue
        home = SingleDeviceSharding(_first_device(sender))
        for receiver in range(world):
            if receiver == sender or receiver not in receivers:
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
    # a sender's arrays must stay posted until every receiver has them: nobody leaves (to a device
    # collective, say, which could block a pull on CPU) before every transfer has arrived
    done.allgather("arrived")
    return out
