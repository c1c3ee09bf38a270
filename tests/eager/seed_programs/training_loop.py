"""A jitted training loop: value_and_grad, an optax optimizer, the model updated in place."""

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


model = nn.Sequential(nn.Linear(4, 8, rngs=spx.Rngs(0)), nn.Tanh(), nn.Linear(8, 2, rngs=spx.Rngs(1)))
fill(model)
x = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
y = jnp.stack([x.sum(-1), x[:, 0] - x[:, 1]], -1)


def loss_fn(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


opt = Optimizer.create(model, optax.sgd(0.1), wrt="parameters")


@spx.jit(mutable="parameters")
def train_step(m, opt, x, y):
    loss, grads = spx.value_and_grad(loss_fn)(m, x, y)
    params, opt = opt.update(spx.tree_state(m).filter("parameters"), grads)
    spx.update(m, params)
    return loss, opt


losses = []
for _ in range(5):
    loss, opt = train_step(model, opt, x, y)
    losses.append(float(loss))
print(json.dumps({"losses": losses, "step": int(opt.step), "final": float(loss_fn(model, x, y))}))
