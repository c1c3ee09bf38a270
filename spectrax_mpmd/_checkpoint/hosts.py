"""What a multi-process save hands orbax (every array on the first process, as host arrays), and
what a restore reads in each process (the arrays whose devices it holds).

orbax writes a `jax.Array` from the processes that hold its shards, and requires every
process to hold some of every array it saves (it refuses an array one process holds
whole, and fails on one it holds no shard of). A pipeline rank's arrays live in one
process only, so a multi-process save sends each process's arrays to the first process
(through the job's cross-process transport, `_facade.gather.exchange`), which passes them
to orbax as host arrays and writes them, with the `meta` and its checksums; the other
processes pass placeholders of the same shapes (`numpy.empty`: address space only, never
written) that orbax does not write. Restores read each array straight onto the devices of
its target, in any process. A save that fails leaves no uncommitted step folder behind
(`removing_partial_steps`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from .._facade.gather import exchange
from .._optim import remote_array

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


def read_held(ocp, read, wants: dict[str, dict]) -> dict[str, dict]:
    """Each item's wanted arrays (`{item: {name: jax.ShapeDtypeStruct}}`): those whose devices this
    process holds read through `read(**orbax_args)` straight onto their shardings (a partial orbax
    read), the others (another process's ranks') global arrays without local shards."""
    held = {
        i: {n: s for n, s in want.items() if s.sharding.is_fully_addressable} for i, want in wants.items()
    }
    items = {
        item: ocp.args.PyTreeRestore(
            arrays, restore_args=ocp.checkpoint_utils.construct_restore_args(arrays), partial_restore=True
        )
        for item, arrays in held.items()
        if arrays
    }
    got = {item: dict(values) for item, values in (read(**items) if items else {}).items()}
    return {
        item: {n: got[item][n] if n in held[item] else remote_array(s) for n, s in want.items()}
        for item, want in wants.items()
    }


TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax names a step folder so until it commits it


@contextlib.contextmanager
def removing_partial_steps(directory: Path, settle: Callable[[], None]):
    """On an error (a save that failed), remove the uncommitted step folders in `directory`, so
    that nothing partial stays where a restore or a later save of that step would look; then
    raise. `settle()` first lets orbax's background work of that save end (its own errors are
    the same failure, already being raised), so nothing writes into a folder being removed.
    The writing process removes them."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            settle()
        if jax.process_index() == PRIMARY:
            for partial in directory.glob(f"*{TMP_SUFFIX}*"):
                shutil.rmtree(partial, ignore_errors=True)
        raise
