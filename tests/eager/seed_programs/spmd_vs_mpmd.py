"""The same script on an SPMD mesh and on an MPMD mesh: spx.run gives the same loss either way."""

import json

import jax
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
        return x + jax.nn.gelu(self.fc(x))


class Model(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.blocks = nn.ModuleList([Block(8, rngs) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(out, y):
    return jnp.mean((out - y) ** 2)


model = Model(spx.Rngs(0))
fill(model)
x = jnp.asarray(np.sin(np.arange(8 * 8)).reshape(8, 8), jnp.float32)
y = jnp.zeros((8, 8))
losses = {}
for name, mesh in {
    "spmd": spx.create_mesh(axis_dims=(1, 2, -1, 1, 1, 1)),
    "mpmd": spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp"),
}.items():
    with mesh:
        loss, _ = spx.run(
            model, inputs=x, targets=y, mesh=mesh, mode="train", loss_fn=loss_fn, microbatches=2
        )
    losses[name] = float(loss)
print(json.dumps({"losses": losses, "is_mpmd": [False, True]}))
