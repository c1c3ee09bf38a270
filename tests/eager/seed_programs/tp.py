"""Tensor parallel: the first projection split by columns, the second by rows, over tp; the logical names
(embed, mlp) mapped by rules; the specs read as
{collection: {path: spec}}, the variables placed, and a jitted training step on the mesh gives the
single-device numbers."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn
from spectrax.sharding import get_named_sharding, get_partition_spec, logical_axis_rules


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


def place(model, mesh):
    """Every variable moved to its NamedSharding, read as {collection: {path: sharding}}."""
    variables = dict(spx.iter_variables(model))
    for _, entries in get_named_sharding(model, mesh).items():  # noqa: PERF102 - the seed shape: (col, entries)
        for path, sharding in entries.items():
            variables[path].value = jax.device_put(variables[path].value, sharding)


class MLP(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, use_bias=False, sharding=("embed", "mlp"), rngs=rngs)
        self.fc2 = nn.Linear(32, 16, use_bias=False, sharding=("mlp", "embed"), rngs=rngs)

    def forward(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


def loss_fn(m, x):
    return jnp.mean((m(x) - x) ** 2)


RULES = [("embed", None), ("mlp", "tp")]
model = MLP(spx.Rngs(0))
fill(model)
x = jnp.asarray(np.cos(np.arange(8 * 16)).reshape(8, 16), jnp.float32)
ref_loss, ref_grads = spx.value_and_grad(loss_fn)(model, x)
mesh = spx.create_mesh(axis_dims=(1, 1, 1, 1, 8, 1))
with logical_axis_rules(RULES), mesh:
    specs = get_partition_spec(model)
    place(model, mesh)
    loss, grads = spx.jit(spx.value_and_grad(loss_fn))(model, x)
rows = [(col, path, str(spec)) for col, entries in specs.items() for path, spec in entries.items()]
print(
    json.dumps(
        {
            "specs": sorted(rows),
            "placed": str(model.fc1.weight.value.sharding.spec),
            "shards": len(model.fc1.weight.value.addressable_shards),
            "shard_shape": list(model.fc1.weight.value.addressable_shards[0].data.shape),
            "loss": float(loss),
            "same_loss": bool(jnp.allclose(loss, ref_loss, rtol=1e-5)),
            "grad_sum": float(sum(jnp.sum(g) for _, _, g in grads.items())),
        }
    )
)
