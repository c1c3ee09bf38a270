"""MPMD training of a homogeneous model with spx.run: four blocks on two pipeline ranks, four
microbatches; the loss and the gradients' global norm agree with the plain single-device step."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn
from spectrax.sharding import logical_axis_rules


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
        self.blocks = nn.ModuleList([Block(8, rngs) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(out, y):
    return jnp.mean((out - y) ** 2)


model = Model(spx.Rngs(0))
fill(model)
x = jnp.asarray(np.sin(np.arange(8 * 8)).reshape(8, 8), jnp.float32)
y = jnp.asarray(np.cos(np.arange(8 * 8)).reshape(8, 8), jnp.float32)
ref_loss, ref_grads = spx.value_and_grad(lambda m: loss_fn(m(x), y))(model)
mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
with logical_axis_rules([("embed", "fsdp")]), mesh:
    loss, grads = spx.run(
        model, inputs=x, targets=y, mesh=mesh, mode="train", loss_fn=loss_fn, microbatches=4
    )


def global_norm(tree):
    return float(np.sqrt(sum(np.sum(np.asarray(g) ** 2) for g in jax.tree.leaves(tree))))


print(
    json.dumps(
        {
            "loss": float(loss),
            "ref_loss": float(ref_loss),
            "grad_norm": global_norm(grads),
            "ref_grad_norm": global_norm(ref_grads),
            "n_grad_leaves": len(jax.tree.leaves(grads)),
        }
    )
)
