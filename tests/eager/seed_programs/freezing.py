"""Freezing a part of a model: the gradient and the optimizer take only the head, so the
backbone's parameters stay as they were while the loss goes down."""

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


class Net(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.backbone = nn.Linear(4, 6, rngs=rngs)
        self.head = nn.Linear(6, 1, rngs=rngs)

    def forward(self, x):
        return self.head(jnp.tanh(self.backbone(x)))


net = Net(spx.Rngs(0))
fill(net)
x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
y = jnp.asarray([[1.0], [0.0], [-1.0]])
trainable = spx.path_startswith("head")
opt = Optimizer.create(net, optax.sgd(0.2), wrt=trainable)
backbone = np.asarray(net.backbone.weight.value).copy()


def loss_fn(m):
    return jnp.mean((m(x) - y) ** 2)


losses = []
for _ in range(4):
    loss, grads = spx.value_and_grad(loss_fn, wrt=trainable)(net)
    params, _ = trainable.partition_state(net, spx.tree_state(net))
    params, opt = opt.update(params, grads)
    spx.update(net, params)
    losses.append(float(loss))
print(
    json.dumps(
        {
            "grad_paths": sorted(p for _, p, _ in grads.items()),
            "losses": losses,
            "backbone_unchanged": bool(np.array_equal(backbone, np.asarray(net.backbone.weight.value))),
        }
    )
)
