"""MPMD training with spx.run, the gradients read rank by rank as the seed library's programs do:
`for c, path, g in grads[r].items()` over each pipeline rank `r`, in that rank's path order, on
that rank's devices; with the block index left out of the paths (see docs/migrating.md)."""

import json
import re

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
        self.blocks = nn.ModuleList([Block(8, rngs) for _ in range(4)])
        self.head = nn.Linear(8, 3, rngs=rngs)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(out, y):
    return jnp.mean((out - y) ** 2)


model = Model(spx.Rngs(0))
fill(model)
x = jnp.asarray(np.sin(np.arange(8 * 6)).reshape(8, 6), jnp.float32)
y = jnp.asarray(np.cos(np.arange(8 * 3)).reshape(8, 3), jnp.float32)
mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
with mesh:
    loss, grads = spx.run(
        model, inputs=x, targets=y, mesh=mesh, mode="train", loss_fn=loss_fn, microbatches=4
    )
per_rank = []
for r in range(mesh.mpmd_mesh.mpmd_dim):
    entries = []
    for c, path, g in grads[r].items():
        where = sorted(d.id for d in g.devices())
        entries.append(
            [c, re.sub(r"blocks\.\d+", "blocks.*", path), list(g.shape), round(float(g.sum()), 5), where]
        )
    per_rank.append({"type": type(grads[r]).__name__, "entries": entries})
print(json.dumps({"loss": float(loss), "per_rank": per_rank}))
