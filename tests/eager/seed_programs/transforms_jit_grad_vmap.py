"""jit, grad (with respect to a selection), vmap over a batch with the module broadcast, and
cond on a traced predicate, each over a module."""

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


model = nn.Sequential(nn.Linear(3, 4, rngs=spx.Rngs(0)), nn.ReLU(), nn.Linear(4, 1, rngs=spx.Rngs(1)))
fill(model)
x = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)

forward = spx.jit(lambda m, x: m(x))
y = forward(model, x)
forward(model, x + 1)
grads = spx.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)
per_example = spx.vmap(lambda m, xi: m(xi[None])[0, 0], in_axes=(None, 0))(model, x)
branch = spx.cond(jnp.sum(x) > 0, lambda m, v: m(v) * 2, lambda m, v: m(v) - 1, model, x)
print(
    json.dumps(
        {
            "y": np.asarray(y).round(6).ravel().tolist(),
            "cache_size": len(forward._spx_compile_cache),
            "grad_leaves": len(list(grads.items())),
            "grad_abs_sum": float(sum(jnp.abs(g).sum() for _, _, g in grads.items())),
            "vmap": np.asarray(per_example).round(6).tolist(),
            "cond": np.asarray(branch).round(6).ravel().tolist(),
        }
    )
)
