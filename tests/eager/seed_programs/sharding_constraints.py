"""Sharding constraints inside a jitted forward: activations pinned to the mesh's dp axis, the
hidden features to tp; the output's sharding as asked, the numbers as on one device."""

import json

import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn
from spectrax.sharding import with_sharding_constraint


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


class Net(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.fc = nn.Linear(8, 8, rngs=rngs)

    def forward(self, x):
        x = with_sharding_constraint(x, ("dp", None))
        h = jnp.tanh(self.fc(x))
        return with_sharding_constraint(h, ("dp", "tp"))


net = Net(spx.Rngs(0))
fill(net)
x = jnp.asarray(np.sin(np.arange(8 * 8)).reshape(8, 8), jnp.float32)
ref = net(x)
mesh = spx.create_mesh(axis_dims=(1, 4, 1, 1, 2, 1))
with mesh:
    y = spx.jit(lambda m, x: m(x))(net, x)
print(
    json.dumps(
        {
            "spec": str(y.sharding.spec),
            "shards": len(y.addressable_shards),
            "shard_shape": list(y.addressable_shards[0].data.shape),
            "same": bool(jnp.allclose(y, ref, atol=1e-6)),
            "sum": float(y.sum()),
        }
    )
)
