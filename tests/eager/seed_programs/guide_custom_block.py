"""A custom block with its own Parameters and Buffers: the variables read as arrays in the forward
(`x @ self.w`), a running counter updated under jit(mutable=...)."""

import json

import jax.numpy as jnp
import numpy as np
import spectrax as spx


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


class ScaledResidual(spx.Module):
    def __init__(self, d):
        super().__init__()
        self.w = spx.Parameter(jnp.eye(d) * 0.5)
        self.gain = spx.Parameter(jnp.ones((d,)))
        self.calls = spx.Buffer(jnp.zeros((), jnp.int32))

    def forward(self, x):
        self.calls.value = self.calls.value + 1
        h = jnp.tanh(x @ self.w) * self.gain
        return x + h * 2 - self.gain


block = ScaledResidual(3)
fill(block)
x = jnp.arange(6.0).reshape(2, 3) / 6
step = spx.jit(lambda m, x: m(x), mutable="buffers")
for _ in range(3):
    y = step(block, x)
w_total = float(jnp.sum(block.w))
print(
    json.dumps(
        {
            "y": np.asarray(y).round(6).tolist(),
            "calls": int(block.calls.value),
            "w_total": w_total,
            "np_shape": list(np.asarray(block.w).shape),
            "neg": float((-block.gain)[0]),
        }
    )
)
