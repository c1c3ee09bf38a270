"""Two learning rates: adapters (LoRA factors) and the remaining parameters each get their own."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import spectrax as spx
from spectrax import nn
from spectrax.contrib import MultiOptimizer


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


base = nn.Linear(4, 4, rngs=spx.Rngs(0))
model = nn.wrap_lora(base, rank=2, alpha=2.0, rngs=spx.Rngs(1))
fill(model)
model.lora_b.value = jnp.full(model.lora_b.value.shape, 0.1)
x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
opt = MultiOptimizer.create(model, {"lora": optax.sgd(0.5), "parameters": optax.sgd(0.01)})
before_a = float(model.lora_a.value.sum())
before_w = float(model.base_module.weight.value.sum())
state = spx.tree_state(model)
trainable = state.filter("parameters", "lora")
grads = spx.grad(lambda m: jnp.sum(m(x) ** 2), wrt=("parameters", "lora"))(model)
new, opt = opt.update(trainable, grads)
spx.update(model, new)
print(
    json.dumps(
        {
            "n_subs": len(opt.subs),
            "lora_a_shape": list(model.lora_a.value.shape),
            "lora_b_shape": list(model.lora_b.value.shape),
            "delta_a": float(model.lora_a.value.sum()) - before_a,
            "delta_w": float(model.base_module.weight.value.sum()) - before_w,
            "y": np.asarray(model(x)).round(6).tolist(),
        }
    )
)
