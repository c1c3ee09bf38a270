"""Selectors: by collection, by Variable type, by module type, by path, combined; counted over a
model and used to choose what a gradient is taken with respect to."""

import json

import jax.numpy as jnp
import spectrax as spx
from spectrax import nn


class Counter(spx.Variable):
    default_kind = "counters"


class Net(spx.Module):
    def __init__(self, rngs):
        super().__init__()
        self.encoder = nn.Linear(4, 4, rngs=rngs)
        self.decoder = nn.Linear(4, 2, rngs=rngs)
        self.norm = nn.LayerNorm(4)
        self.seen = Counter(jnp.zeros(()))

    def forward(self, x):
        return self.decoder(self.norm(self.encoder(x)))


net = Net(spx.Rngs(0))


def count(sel):
    return len(list(spx.iter_variables(net, select=sel)))


linear_vars = spx.select().at_instances_of(nn.Linear)
grads = spx.grad(lambda m: jnp.sum(m(jnp.ones((1, 4)))), wrt=spx.path_contains("decoder"))(net)
print(
    json.dumps(
        {
            "all": count(None),
            "parameters": count("parameters"),
            "counters": count("counters"),
            "of_type_counter": count(spx.of_type(Counter)),
            "linear": count(linear_vars),
            "decoder": count(spx.path_contains("decoder")),
            "startswith_enc": count(spx.path_startswith("encoder")),
            "not_parameters": count(spx.not_(spx.select().variables("parameters"))),
            "union": count(spx.any_of(spx.path_contains("decoder"), spx.of_type(Counter))),
            "grad_paths": sorted(p for _, p, _ in grads.items()),
            "modules": len(list(spx.iter_modules(net, skip_root=True))),
        }
    )
)
