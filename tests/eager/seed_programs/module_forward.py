"""A module with a forward, called on a batch; its parameters counted and listed by collection."""

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


class MLP(spx.Module):
    def __init__(self, d, h, rngs):
        super().__init__()
        self.fc1 = nn.Linear(d, h, rngs=rngs)
        self.fc2 = nn.Linear(h, d, rngs=rngs)

    def forward(self, x):
        return self.fc2(jax_gelu(self.fc1(x)))


def jax_gelu(x):
    return x * 0.5 * (1.0 + jnp.tanh(0.7978845608 * (x + 0.044715 * x**3)))


model = MLP(4, 8, spx.Rngs(0))
fill(model)
x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
y = model(x)
gdef, state = spx.export(model)
print(
    json.dumps(
        {
            "shape": list(y.shape),
            "y": np.asarray(y).round(6).tolist(),
            "weight_shape": list(model.fc1.weight.value.shape),
            "count": int(spx.inspect.count_parameters(model)),
            "collections": sorted(state.collections()),
            "n_leaves": len(list(state.items())),
            "item_len": len(next(iter(state.items()))),
        }
    )
)
