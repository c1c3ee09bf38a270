"""The stage-local layout of an MPMD mesh: the pipeline axis and the SPMD axes, one submesh per
rank, an array placed on one rank's submesh by a spec over the SPMD axes."""

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from spectrax.runtime.types import MpMdMesh

devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
mm = MpMdMesh(Mesh(devices, ("pp", "fsdp", "tp")), "pp")
subs = mm.unstack()
sharding = mm.sub_sharding(1, PartitionSpec("fsdp", "tp"))
x = jax.device_put(jnp.arange(16.0).reshape(4, 4), sharding)
try:
    mm.sub_sharding(0, PartitionSpec("pp"))
    refused = False
except ValueError:
    refused = True
print(
    json.dumps(
        {
            "mpmd_dim": mm.mpmd_dim,
            "mpmd_axis_name": mm.mpmd_axis_name,
            "spmd_axis_names": list(mm.spmd_axis_names),
            "submesh_axes": [list(s.axis_names) for s in subs],
            "submesh_devices": [sorted(d.id for d in s.devices.flat) for s in subs],
            "placed_on": sorted(d.id for d in x.devices()),
            "shard_shape": list(x.addressable_shards[0].data.shape),
            "pp_refused": refused,
            "jax_mesh_shape": dict(mm.jax_mesh.shape),
        }
    )
)
