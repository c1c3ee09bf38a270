"""A greedy decode loop with a key/value cache held in Variables of a "cache" collection: one
jitted step per token writes the cache in place; the tokens match a decode without a cache."""

import json

import jax
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


class Cache(spx.Variable):
    default_kind = "cache"


class TinyLM(spx.Module):
    def __init__(self, vocab, d, max_len, rngs):
        super().__init__()
        self.embed = nn.Embed(vocab, d, rngs=rngs)
        self.qkv = nn.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.out = nn.Linear(d, vocab, use_bias=False, rngs=rngs)
        self.k_cache = Cache(jnp.zeros((max_len, d)))
        self.v_cache = Cache(jnp.zeros((max_len, d)))
        self.index = Cache(jnp.zeros((), jnp.int32))

    def full(self, tokens):
        q, k, v = jnp.split(self.qkv(self.embed(tokens)), 3, axis=-1)
        t = tokens.shape[0]
        logits = q @ k.T / np.sqrt(q.shape[-1])
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e9)
        return self.out(jax.nn.softmax(logits) @ v)

    def step(self, token):
        q, k, v = jnp.split(self.qkv(self.embed(token[None])), 3, axis=-1)
        i = self.index.value
        self.k_cache.value = jax.lax.dynamic_update_slice(self.k_cache.value, k, (i, 0))
        self.v_cache.value = jax.lax.dynamic_update_slice(self.v_cache.value, v, (i, 0))
        self.index.value = i + 1
        logits = q @ self.k_cache.value.T / np.sqrt(q.shape[-1])
        logits = jnp.where(jnp.arange(self.k_cache.value.shape[0]) <= i, logits, -1e9)
        return self.out(jax.nn.softmax(logits) @ self.v_cache.value)[0]


model = TinyLM(vocab=7, d=8, max_len=8, rngs=spx.Rngs(0))
fill(model)
step = spx.jit(lambda m, tok: m.step(tok), mutable="cache")
tokens = [3]
for _ in range(5):
    logits = step(model, jnp.asarray(tokens[-1]))
    tokens.append(int(jnp.argmax(logits)))
reference = [3]
for _ in range(5):
    reference.append(int(jnp.argmax(model.full(jnp.asarray(reference))[-1])))
print(
    json.dumps(
        {
            "tokens": tokens,
            "matches_full": tokens == reference,
            "index": int(model.index.value),
            "cache_rows_written": int(jnp.sum(jnp.any(model.k_cache.value != 0, axis=-1))),
            "last_logits": np.asarray(logits).round(5).tolist(),
        }
    )
)
