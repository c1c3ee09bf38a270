"""A 2-process save for the checkpoint-owner test: `a` given as a NumPy array (every process holds
it), `b` on process 1's two devices (sharded over them), saved with `mp.save_checkpoint`.

    owners_worker.py CKPT
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import spectrax_mpmd as mp  # noqa: E402

mp.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

A = np.arange(6, dtype=np.float32) * 3
B = np.arange(16, dtype=np.float32).reshape(4, 4)


def main() -> None:
    held = [d for d in jax.devices() if d.process_index == 1]
    sharding = NamedSharding(Mesh(np.array(held), ("x",)), PartitionSpec("x"))
    if jax.process_index() == 1:
        b = jax.device_put(jnp.asarray(B), sharding)
    else:  # another process's array: a global array without local shards here
        b = jax.make_array_from_single_device_arrays(B.shape, sharding, [], dtype=B.dtype)
    mp.save_checkpoint(sys.argv[1], 1, params={"a": A, "b": b})


if __name__ == "__main__":
    main()
