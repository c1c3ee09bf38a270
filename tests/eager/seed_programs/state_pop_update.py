"""A model's State: exported, filtered, popped, updated and bound back."""

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
        self.lin = nn.Linear(3, 3, rngs=rngs)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


net = Net(spx.Rngs(0))
fill(net)
gdef, state = spx.export(net)
collections = sorted(state.collections())
other = spx.bind(gdef, state)
params = state.filter("parameters")
n_params = len(list(params.items()))
doubled = params.map(lambda v: v * 2)
spx.update(net, doubled)
w_sum = float(net.lin.weight.value.sum())
popped = spx.pop(net, "batch_stats")
print(
    json.dumps(
        {
            "collections": collections,
            "n_params": n_params,
            "n_buffers": len(list(popped.items())),
            "popped_collections": sorted(popped.collections()),
            "w_sum_doubled": w_sum,
            "bound_sum": float(other.lin.weight.value.sum()),
            "triples": all(len(t) == 3 for t in state.items()),
            "paths_are_pairs": all(len(p) == 2 for p in state.paths()),
        }
    )
)
