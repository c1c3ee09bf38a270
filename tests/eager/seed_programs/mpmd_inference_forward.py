"""Pipelined inference: spx.run in forward mode over two ranks and four microbatches returns the
whole batch's outputs, equal to the model called on one device."""

import json

import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


class Block(spx.Module):
    def __init__(self, d, rngs):
        super().__init__()
        self.fc = nn.Linear(d, d, rngs=rngs)

    def forward(self, x):
        return x + jnp.tanh(self.fc(x))


class Model(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.embed = nn.Linear(6, 8, rngs=rngs)
        self.blocks = nn.ModuleList([Block(8, rngs) for _ in range(2)])
        self.head = nn.Linear(8, 3, rngs=rngs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


model = Model(spx.Rngs(0))
fill(model)
x = jnp.asarray(np.sin(np.arange(8 * 6)).reshape(8, 6), jnp.float32)
ref = model(x)
mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
with mesh:
    out = spx.run(model, inputs=x, mesh=mesh, mode="forward", microbatches=4)
print(
    json.dumps(
        {
            "shape": list(out.shape),
            "same": bool(jnp.allclose(out, ref, atol=1e-5)),
            "first": np.asarray(out[0]).round(5).tolist(),
        }
    )
)
