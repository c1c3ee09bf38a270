"""Logical axis rules: one model annotated with model-level names, placed by two rule sets on the
same mesh; nested rule blocks and the rules in force."""

import json

import jax
import spectrax as spx
from spectrax import nn
from spectrax.sharding import current_axis_rules, get_partition_spec, logical_axis_rules


class Block(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.wi = nn.Linear(8, 16, use_bias=False, sharding=("embed", "mlp"), rngs=rngs)
        self.wo = nn.Linear(16, 8, use_bias=False, sharding=("mlp", "embed"), rngs=rngs)

    def forward(self, x):
        return self.wo(jax.nn.relu(self.wi(x)))


block = Block(spx.Rngs(0))
mesh = spx.create_mesh(axis_dims=(1, 2, 2, 1, 2, 1))
out = {}
with mesh:
    for name, rules in {
        "fsdp_tp": [("embed", "fsdp"), ("mlp", "tp")],
        "dp_only": [("embed", None), ("mlp", None)],
        "both_on_mlp": [("embed", None), ("mlp", ("fsdp", "tp"))],
    }.items():
        with logical_axis_rules(rules):
            specs = get_partition_spec(block)
            out[name] = {path: str(spec) for col, entries in specs.items() for path, spec in entries.items()}
    with logical_axis_rules([("embed", "fsdp")]), logical_axis_rules([("mlp", "tp")]):
        inner = current_axis_rules()
        out["nested"] = [str(inner.get("embed")), str(inner.get("mlp"))]
print(json.dumps(out))
