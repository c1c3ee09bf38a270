"""An Optimizer over a model: its step counter read as an int, adamw updates, the state's leaves."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import spectrax as spx
from spectrax import nn
from spectrax.contrib import Optimizer


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


model = nn.Linear(3, 2, rngs=spx.Rngs(0))
fill(model)
x = jnp.arange(6.0).reshape(2, 3) / 6
opt = Optimizer.create(model, optax.adamw(1e-2, weight_decay=0.1), wrt="parameters")
steps = [int(opt.step)]
for _ in range(3):
    grads = spx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    params, opt = opt.update(spx.tree_state(model).filter("parameters"), grads)
    spx.update(model, params)
    steps.append(int(opt.step))
print(
    json.dumps(
        {
            "steps": steps,
            "w": np.asarray(model.weight.value).round(6).tolist(),
            "b": np.asarray(model.bias.value).round(6).tolist(),
        }
    )
)
