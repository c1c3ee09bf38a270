"""What a multi-process save hands orbax (every array as a global array that its owner writes),
and what a restore reads in each process (the arrays whose devices it holds).

orbax writes a `jax.Array` of a multi-process job from the processes that hold its
shards, each writing the shards whose replica id is 0 into its own files (OCDBT's
`ocdbt.process_<i>`), and it requires every process to hold part of every array it saves
(it refuses an array one process holds whole). A pipeline rank's arrays live in one
process, so a save passes each array as a global array over every process
(`for_owners`): the owner's shards come first in its mesh, so they are replica 0 and
orbax writes them from the owner; every other process lends, as the array's other
replicas, buffers of zeros on its own devices (one per shard shape, dtype and device,
shared by the arrays of that shape), which orbax never writes (replica-parallel
writing is off, see `orbax_io`). Nothing crosses processes but the arrays'
checksums. orbax commits the step (its commit marker, written by the first process)
only once every process has finished its part; restores read each array straight
onto the devices of its target, in any process. A save that fails leaves no
uncommitted step folder behind (`removing_partial_steps`).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from .._comm import Exchange
from .._optim import remote_array
from .digest import checksum, checksums_by_name
from .layout import CheckpointError

PRIMARY = 0  # the process that commits (orbax's primary host)
COPIES = "checkpoint_copies"  # the mesh axis of a saved array's copies: its owner's first


def for_owners(items: dict[str, dict], checksums: bool) -> tuple[dict[str, dict], dict[str, dict]]:
    """`{item: {name: array}}` as global arrays that orbax writes from each array's owner, and
    `{item: {name: checksum}}` (empty without `checksums`), the same on every process.

    In one process the arrays are returned as given. An array one process holds is its
    owner's; one every process holds (e.g. a leaf given as a NumPy array) the first
    process's. Every process calls this with the same names, at the same point of the
    same script.
    """
    if jax.process_count() == 1:  # every array held here, written as it is
        return items, {item: checksums_by_name(arrays) for item, arrays in items.items()} if checksums else {}
    names = [(item, name) for item, arrays in items.items() for name in arrays]
    arrays = [items[i][n] for i, n in names]
    held = [2 if x.is_fully_addressable else 1 if x.addressable_shards else 0 for x in arrays]
    sums = [checksum(x) if h == 2 and checksums else None for x, h in zip(arrays, held)]
    views = [json.loads(v) for v in Exchange("checkpoint").allgather(json.dumps([held, sums]))]
    world = jax.process_count()
    lent: dict = {}  # (shape, dtype, device) -> the buffer of zeros this process lends
    out: dict[str, dict] = {item: {} for item in items}
    recorded: dict[str, dict] = {item: {} for item in items} if checksums else {}
    for k, ((item, name), x) in enumerate(zip(names, arrays)):
        holders = [p for p in range(world) if views[p][0][k] == 2]
        if not holders:  # a global array over processes: orbax writes it from its holders
            if not all(views[p][0][k] for p in range(world)):
                raise CheckpointError(
                    f"save: {item} array {name!r} is spread over some processes but not all; orbax saves "
                    "an array held by one process (a pipeline rank's), by every process, or spread over all."
                )
            out[item][name] = x
            continue
        owner = PRIMARY if PRIMARY in holders else holders[0]
        out[item][name] = _owned(x, owner, len(holders) == world, lent, f"{item} array {name!r}")
        if checksums:
            recorded[item][name] = views[owner][1][k]
    return out, recorded


def _owned(x: jax.Array, owner: int, everywhere: bool, lent: dict, what: str) -> jax.Array:
    """`x` as a global array over every process whose replica 0 is the owner's data: a mesh with
    the owner's devices first along `COPIES`, then as many devices of each other process, which
    lend buffers of zeros."""
    me = jax.process_index()
    if everywhere:  # each process holds its own copy: the owner's, from its first device
        devices, axes, spec, kind = np.array(_devices(owner, 1, what)), ("device",), PartitionSpec(), None
        x = jax.device_put(x, devices[0]) if me == owner else x
    elif isinstance(x.sharding, NamedSharding):
        mesh, spec, kind = x.sharding.mesh, x.sharding.spec, x.sharding.memory_kind
        devices, axes = mesh.devices, mesh.axis_names
    elif isinstance(x.sharding, SingleDeviceSharding):
        devices, axes, spec = np.array(list(x.sharding.device_set)), ("device",), PartitionSpec()
        kind = x.sharding.memory_kind
    else:
        raise CheckpointError(
            f"save: {what} has a {type(x.sharding).__name__}; a multi-process checkpoint saves arrays "
            "placed with a NamedSharding or on one device."
        )
    others = [q for q in range(jax.process_count()) if q != owner]
    rows = [devices] + [np.array(_devices(q, devices.size, what)).reshape(devices.shape) for q in others]
    sharding = NamedSharding(Mesh(np.stack(rows), (COPIES, *axes)), spec, memory_kind=kind)
    if me == owner:
        data = [s.data for s in x.addressable_shards]
    else:
        shape = sharding.shard_shape(x.shape)
        data = [_zeros(lent, shape, x.dtype, d, kind) for d in rows[1 + others.index(me)].flat]
    out = jax.make_array_from_single_device_arrays(x.shape, sharding, data)
    if me != owner and any(s.replica_id == 0 for s in out.addressable_shards):
        raise CheckpointError(f"save: {what}: a lent copy would be written as the array (replica 0).")
    return out


def _devices(process: int, n: int, what: str) -> list:
    """The first `n` devices of `process`, by id."""
    found = sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)
    if len(found) < n:
        raise CheckpointError(
            f"save: {what} lies on {n} devices but process {process} has {len(found)}; a multi-process "
            "checkpoint needs every process to have at least as many devices as one pipeline rank."
        )
    return found[:n]


def _zeros(lent: dict, shape, dtype, device, kind) -> jax.Array:
    key = (tuple(shape), jnp.dtype(dtype), device)
    if key not in lent:
        lent[key] = jax.device_put(np.zeros(shape, dtype), SingleDeviceSharding(device, memory_kind=kind))
    return lent[key]


def read_held(ocp, read, wants: dict[str, dict], host_bytes: int | None = None) -> dict[str, dict]:
    """Each item's wanted arrays (`{item: {name: jax.ShapeDtypeStruct}}`): those whose devices this
    process holds read through `read(**orbax_args)` straight onto their shardings (partial orbax
    reads, one batch of `host_batches` at a time, so the host never stages more), the
    others (another process's ranks') global arrays without local shards."""
    held = {
        i: {n: s for n, s in want.items() if s.sharding.is_fully_addressable} for i, want in wants.items()
    }
    got: dict[str, dict] = {item: {} for item in wants}
    for batch in host_batches(held, host_bytes):
        items = {
            item: ocp.args.PyTreeRestore(
                arrays, restore_args=ocp.checkpoint_utils.construct_restore_args(arrays), partial_restore=True
            )
            for item, arrays in batch.items()
        }
        for item, values in read(**items).items():
            got[item].update(values)
    return {
        item: {n: got[item][n] if n in held[item] else remote_array(s) for n, s in want.items()}
        for item, want in wants.items()
    }


HOST_BATCH_BYTES = 64 << 20  # the default least bound of one read's arrays (see `host_batches`)


def _nbytes(spec: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * np.dtype(spec.dtype).itemsize


def host_batches(held: dict[str, dict], host_bytes: int | None) -> list[dict[str, dict]]:
    """`held`'s arrays (`{item: {name: spec}}`) in batches of at most `max(largest array, host_bytes)`
    bytes (`host_bytes` None: `HOST_BATCH_BYTES`), in order: a restore's host staging is one batch."""
    if host_bytes is not None and (
        isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes < 0
    ):
        raise CheckpointError(
            f"restore: host_bytes must be None or a non-negative int of bytes (the most read at once), "
            f"got {host_bytes!r}."
        )
    entries = [(item, name, spec) for item, arrays in held.items() for name, spec in arrays.items()]
    if not entries:
        return []
    bound = max(max(_nbytes(s) for *_, s in entries), HOST_BATCH_BYTES if host_bytes is None else host_bytes)
    batches: list[dict[str, dict]] = [{}]
    size = 0
    for item, name, spec in entries:
        if size and size + _nbytes(spec) > bound:
            batches.append({})
            size = 0
        batches[-1].setdefault(item, {})[name] = spec
        size += _nbytes(spec)
    return batches


TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax names a step folder so until it commits it


def uncommitted(directory: Path, step: int | None = None) -> list[Path]:
    """The step folders in `directory` that orbax has not committed (of `step` only, if given)."""
    return sorted(directory.glob(f"{'*' if step is None else step}{TMP_SUFFIX}*"))


@contextlib.contextmanager
def removing_partial_steps(directory: Path, settle: Callable[[], None]):
    """On an error (a save that failed), remove the uncommitted step folders in `directory`, so
    that nothing partial stays where a restore or a later save of that step would look; then
    raise. `settle()` first lets orbax's background work of that save end (its own errors are
    the same failure, already being raised), so nothing writes into a folder being removed.
    The committing process removes them."""
    try:
        yield
    except BaseException:
        settle()
        remove_uncommitted(directory)
        raise


def remove_uncommitted(directory: Path) -> None:
    """Remove the uncommitted step folders in `directory` (the committing process does): what a
    failed save, or one whose process was killed, left."""
    if jax.process_index() == PRIMARY:
        for partial in uncommitted(directory):
            shutil.rmtree(partial, ignore_errors=True)
