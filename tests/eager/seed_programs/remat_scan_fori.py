"""remat of a forward, scan of a module over a sequence (`ys = spx.scan(fn, module, xs)`),
remat_scan, and fori_loop with a user carry."""

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


cell = nn.Linear(3, 3, rngs=spx.Rngs(0))
fill(cell)
xs = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)

ys = spx.scan(lambda m, x: jnp.tanh(m(x)), cell, xs)
ys_remat = spx.remat_scan(lambda m, x: jnp.tanh(m(x)), cell, xs)
remat_loss = spx.remat(lambda m, x: jnp.sum(jnp.tanh(m(x)) ** 2))
g = spx.grad(remat_loss)(cell, xs)
final = spx.fori_loop(0, 4, lambda i, m, h: jnp.tanh(m(h)) + i, cell, xs[0])
print(
    json.dumps(
        {
            "ys_shape": list(ys.shape),
            "ys": np.asarray(ys).round(6).ravel().tolist(),
            "same_with_remat": bool(jnp.allclose(ys, ys_remat)),
            "remat_grad_sum": float(sum(v.sum() for _, _, v in g.items())),
            "fori": np.asarray(final).round(6).tolist(),
        }
    )
)
