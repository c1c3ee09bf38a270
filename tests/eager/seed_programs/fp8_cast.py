"""FP8 training layers: an Fp8Linear next to the Linear it replaces, with its scaling metadata in
its own collection; outputs agree with the full-precision layer to FP8 rounding."""

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


ref = nn.Linear(8, 4, rngs=spx.Rngs(0))
fp8 = nn.Fp8Linear(8, 4, rngs=spx.Rngs(0))
fill(ref)
fill(fp8)
x = jnp.linspace(-1.0, 1.0, 16).reshape(2, 8)
y_ref = ref(x)
y = spx.jit(lambda m, x: m(x), mutable=spx.not_(spx.select().variables("parameters")))(fp8, x)
kinds = sorted({v.kind for _, v in spx.iter_variables(fp8)})
print(
    json.dumps(
        {
            "shape": list(y.shape),
            "close": bool(jnp.allclose(y, y_ref, atol=0.05)),
            "max_err_below": float(jnp.max(jnp.abs(y - y_ref))) < 0.05,
            "kinds": kinds,
            "param_count": int(spx.inspect.count_parameters(fp8)),
        }
    )
)
