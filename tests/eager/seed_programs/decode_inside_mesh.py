"""Greedy decoding inside `with mesh:` of an MPMD mesh: each step a pipelined forward with
spx.run, then plain JAX on its logits (`jnp.argmax`, `jnp.concatenate`) picks and appends the
next token; the tokens equal those of the model called on one device."""

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


class Block(spx.Module):
    def __init__(self, d, rngs):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d, rngs=rngs)

    def forward(self, x):
        return x + jnp.tanh(self.fc(self.norm(x)))


class LM(spx.Module):
    def __init__(self, vocab, d, layers, rngs):
        super().__init__()
        self.embed = nn.Embed(vocab, d, rngs=rngs)
        self.blocks = nn.ModuleList([Block(d, rngs) for _ in range(layers)])
        self.head = nn.Linear(d, vocab, rngs=rngs)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def greedy(step, ids, n):
    for _ in range(n):
        logits = step(ids)
        nxt = jnp.argmax(logits[:, -1:, :], axis=-1)
        ids = jnp.concatenate([ids, nxt.astype(ids.dtype)], axis=1)
    return ids


model = LM(vocab=23, d=12, layers=4, rngs=spx.Rngs(0))
fill(model)
prompt = jnp.asarray([[1, 5, 2], [7, 3, 11]], jnp.int32)
reference = greedy(model, prompt, 4)
mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
with mesh:
    tokens = greedy(lambda ids: spx.run(model, inputs=ids, mesh=mesh, mode="forward"), prompt, 4)
    last = spx.run(model, inputs=tokens, mesh=mesh, mode="forward")
    probs = jnp.exp(last[:, -1] - jnp.max(last[:, -1], axis=-1, keepdims=True))
    top = float(jnp.max(probs / probs.sum(-1, keepdims=True)))
print(
    json.dumps(
        {
            "tokens": np.asarray(tokens).tolist(),
            "same_as_one_device": bool((tokens == reference).all()),
            "top_prob": top,
        }
    )
)
