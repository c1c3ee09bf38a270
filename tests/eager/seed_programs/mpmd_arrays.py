"""MPMD arrays: one value held on a chosen set of pipeline ranks, one shard per rank; placed on
the ranks' submeshes, replaced shard by shard, summed on the host."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from spectrax.runtime.types import MpMdMesh, StagesArray, abstract_stages_array

mm = MpMdMesh(Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("pp", "dp")), "pp")
zeros = abstract_stages_array((2, 3), jnp.float32, [3, 1, 1])
shards = {r: jax.device_put(jnp.full((2, 3), float(r)), mm.sub_sharding(r)) for r in (0, 2)}
arr = StagesArray(shards=shards)
arr2 = arr.with_shard(2, jax.device_put(jnp.ones((2, 3)), mm.sub_sharding(2)))
try:
    arr.to_local_array()
    single = True
except ValueError:
    single = False
leaves = jax.tree.leaves(arr)
print(
    json.dumps(
        {
            "zeros_ranks": sorted(zeros.mpmd_idxs),
            "zeros_shape": list(zeros.shape),
            "ranks": sorted(arr.mpmd_idxs),
            "len": len(arr),
            "contains": [0 in arr, 1 in arr],
            "sum": np.asarray(arr.reduce_sum()).tolist(),
            "sum_after_replace": float(np.asarray(arr2.reduce_sum()).sum()),
            "devices_rank2": sorted(d.id for d in arr[2].devices()),
            "to_local_needs_one": not single,
            "n_leaves": len(leaves),
            "dtype": str(arr.dtype),
            "replicated": arr.replicated,
        }
    )
)
