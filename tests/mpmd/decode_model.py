"""A decode step written the way a user writes one: plain JAX, no `spectrax_core.nn` classes.

Attention layers with learned positions and a per-layer KV cache indexed by
position, one top-2 mixture-of-experts layer routed in `jnp`, a tied head.
`decode_step(n_stages)` puts `n_stages - 1` `sxstage_iter` markers between the
layers. `alone` decodes one prompt unsplit, token by token: the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import spectrax_mpmd as mp
from spectrax_core.models import Sampler, sample_tokens

VOCAB, D, HEADS, LAYERS, EXPERTS, MAX_POS = 17, 16, 2, 4, 4, 32
MOE_LAYER = 2


def init_params(key):
    keys = iter(jax.random.split(key, 8 * LAYERS + 4))
    dense = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[-2])  # noqa: E731
    layers = []
    for i in range(LAYERS):
        layer = dict(qkv=dense(D, 3 * D), out=dense(D, D))
        if i == MOE_LAYER:
            layer.update(router=dense(D, EXPERTS), up=dense(EXPERTS, D, 2 * D), down=dense(EXPERTS, 2 * D, D))
        else:
            layer.update(up=dense(D, 2 * D), down=dense(2 * D, D))
        layers.append(layer)
    return dict(embed=dense(VOCAB, D), pos=0.1 * dense(MAX_POS, D), layers=layers)


def init_cache(batch, max_len):
    kv = lambda: jnp.zeros((batch, max_len, HEADS, D // HEADS))  # noqa: E731
    return [dict(k=kv(), v=kv()) for _ in range(LAYERS)]


def norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def attention(layer, cache, x, positions):
    b, n, _ = x.shape
    q, k, v = jnp.split(norm(x) @ layer["qkv"], 3, axis=-1)
    q, k, v = (a.reshape(b, n, HEADS, D // HEADS) for a in (q, k, v))
    write = jax.vmap(lambda c, p, new: c.at[p].set(new))  # each token's entry at its own position
    cache = dict(k=write(cache["k"], positions, k), v=write(cache["v"], positions, v))
    scores = jnp.einsum("bqhd,bshd->bhqs", q, cache["k"]) / np.sqrt(D // HEADS)
    visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]
    scores = jnp.where(visible[:, None], scores, -1e30)
    out = jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(scores, axis=-1), cache["v"])
    return x + out.reshape(b, n, D) @ layer["out"], cache


def moe(layer, x):
    h = norm(x)
    gates, chosen = jax.lax.top_k(h @ layer["router"], 2)
    weights = jnp.sum(jax.nn.one_hot(chosen, EXPERTS) * jax.nn.softmax(gates, -1)[..., None], axis=-2)
    hidden = jax.nn.gelu(jnp.einsum("bld,edf->blef", h, layer["up"]))
    return x + jnp.einsum("blef,efd,ble->bld", hidden, layer["down"], weights)


def mlp(layer, x):
    return x + jax.nn.gelu(norm(x) @ layer["up"]) @ layer["down"]


def decode_step(n_stages):
    ends = {round(LAYERS * (s + 1) / n_stages) - 1 for s in range(n_stages - 1)}  # layers ending a stage

    def step(params, cache, tokens, positions):
        x = params["embed"][tokens] + params["pos"][positions]
        new = []
        for i, layer in enumerate(params["layers"]):
            x, c = attention(layer, cache[i], x, positions)
            x = moe(layer, x) if i == MOE_LAYER else mlp(layer, x)
            new.append(c)
            if i in ends:
                x = mp.sxstage_iter(x)
        return norm(x) @ params["embed"].T, new

    return step


@functools.cache
def unsplit_step():
    return jax.jit(decode_step(1))


def alone(params, prompt, budget, *, sampler=Sampler(), key=None, stop_tokens=(), pad_id=0, max_len=None):
    """One prompt's new tokens (`budget` of them, `pad_id` after a stop token), decoded unsplit."""
    step = unsplit_step()
    key = jax.random.key(0) if key is None else key
    n = len(prompt)
    cache = init_cache(1, max_len or n + budget)
    tokens, positions = jnp.asarray([prompt], jnp.int32), jnp.arange(n, dtype=jnp.int32)[None]
    out, done = [], False
    for t in range(budget):
        logits, cache = step(params, cache, tokens, positions)
        token = int(sample_tokens(logits[:, -1], key[None], jnp.int32(t), sampler)[0])
        out.append(pad_id if done else token)
        done = done or token in stop_tokens
        tokens, positions = jnp.asarray([[token]], jnp.int32), jnp.asarray([[n + t]], jnp.int32)
    return out
