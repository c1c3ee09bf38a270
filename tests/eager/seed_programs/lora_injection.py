"""LoRA injected into the projections of a trained model: the base is unchanged at first (the B
factor starts at zero), only the adapters are trained, and the adapters are counted."""

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
        self.up = nn.Linear(4, 8, rngs=rngs)
        self.down = nn.Linear(8, 4, rngs=rngs)

    def forward(self, x):
        return self.down(jnp.tanh(self.up(x)))


net = Net(spx.Rngs(0))
fill(net)
x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
before = net(x)
for name in ("up", "down"):
    setattr(net, name, nn.wrap_lora(getattr(net, name), rank=2, alpha=4.0, rngs=spx.Rngs(1)))
fill(net)
for name in ("up", "down"):
    getattr(net, name).lora_b.value = jnp.zeros_like(getattr(net, name).lora_b.value)
unchanged = bool(jnp.allclose(net(x), before, atol=1e-6))
opt = Optimizer.create(net, optax.sgd(0.1), wrt="lora")
base_before = float(net.up.base_module.weight.value.sum())
for _ in range(2):
    grads = spx.grad(lambda m: jnp.mean((m(x) - 1.0) ** 2), wrt="lora")(net)
    params, opt = opt.update(spx.tree_state(net).filter("lora"), grads)
    spx.update(net, params)
print(
    json.dumps(
        {
            "unchanged_at_start": unchanged,
            "is_lora": isinstance(net.up, nn.LoRA),
            "n_lora": len(list(spx.iter_variables(net, select="lora"))),
            "lora_count": int(sum(v.value.size for _, v in spx.iter_variables(net, select="lora"))),
            "base_frozen": float(net.up.base_module.weight.value.sum()) == base_before,
            "loss": float(jnp.mean((net(x) - 1.0) ** 2)),
            "b_norm": float(jnp.linalg.norm(net.down.lora_b.value)),
        }
    )
)
