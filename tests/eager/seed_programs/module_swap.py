"""Swapping a sub-module of a live model: the jitted step builds a new program for the new
structure (its compile cache grows by one) and computes with the new layer."""

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


class Net(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.fc = nn.Linear(3, 3, rngs=rngs)
        self.act = nn.ReLU()
        self.out = nn.Linear(3, 1, rngs=rngs)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


net = Net(spx.Rngs(0))
fill(net)
x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
step = spx.jit(lambda m, x: m(x))
a = step(net, x)
step(net, x * 2)
size_before = len(step._spx_compile_cache)
net.act = nn.Tanh()
b = step(net, x)
net.fc = nn.Linear(3, 3, use_bias=False, rngs=spx.Rngs(2))
fill(net)
c = step(net, x)
print(
    json.dumps(
        {
            "relu": np.asarray(a).round(6).ravel().tolist(),
            "tanh": np.asarray(b).round(6).ravel().tolist(),
            "no_bias": np.asarray(c).round(6).ravel().tolist(),
            "cache_sizes": [size_before, len(step._spx_compile_cache)],
        }
    )
)
