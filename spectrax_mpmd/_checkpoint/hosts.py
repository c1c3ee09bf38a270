"""What a multi-process save hands orbax: every array on the first process, as host arrays.

orbax writes a `jax.Array` from the processes that hold its shards, and requires every
process to hold some of every array it saves (it refuses an array one process holds
whole, and fails on one it holds no shard of). A pipeline rank's arrays live in one
process only, so a multi-process save sends each process's arrays to the first process
(through the job's cross-process transport, `_facade.gather.exchange`), which passes them
to orbax as host arrays and writes them, with the `meta` and its checksums; the other
processes pass placeholders of the same shapes (`numpy.empty`: address space only, never
written) that orbax does not write. Restores read each array straight onto the devices of
its target, in any process.
"""

from __future__ import annotations

import jax
import numpy as np

from .._facade.gather import exchange

PRIMARY = 0  # the process that writes (orbax's primary host)


def on_primary(items: dict[str, dict]) -> dict[str, dict]:
    """`{item: {name: array}}` as host arrays on the primary process, placeholders elsewhere."""
    names = [(item, name) for item, arrays in items.items() for name in arrays]
    arrays = [items[item][name] for item, name in names]
    arrays = exchange(arrays, [name for _, name in names], [PRIMARY])
    me = jax.process_index()
    out: dict[str, dict] = {item: {} for item in items}
    for (item, name), x in zip(names, arrays):
        out[item][name] = np.asarray(x) if me == PRIMARY else np.empty(x.shape, x.dtype)
    return out
