"""The main job's LM written as a user's decode step in plain JAX (no `spectrax_core.nn`), for
`StepDecoder`: byte vocabulary, `d_model` 128, `layers` pre-norm blocks (4 heads, learned
positions, an MLP of 512), a tied head, one `sxstage_iter` after each stage's blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import spectrax_mpmd as mp

VOCAB, D, HEADS, FF, MAX_POS = 256, 128, 4, 512, 512


def init_params(key, layers: int):
    keys = iter(jax.random.split(key, 4 * layers + 2))
    dense = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[-2])  # noqa: E731
    blocks = [
        dict(qkv=dense(D, 3 * D), out=dense(D, D), up=dense(D, FF), down=dense(FF, D)) for _ in range(layers)
    ]
    return dict(embed=dense(VOCAB, D), pos=0.02 * dense(MAX_POS, D), blocks=blocks)


def init_cache(layers: int):
    def make(batch, max_len):
        kv = lambda: jnp.zeros((batch, max_len, HEADS, D // HEADS))  # noqa: E731
        return [dict(k=kv(), v=kv()) for _ in range(layers)]

    return make


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _block(p, cache, x, positions):
    b, n, _ = x.shape
    q, k, v = (a.reshape(b, n, HEADS, D // HEADS) for a in jnp.split(_norm(x) @ p["qkv"], 3, -1))
    write = jax.vmap(lambda c, at, new: c.at[at].set(new))
    cache = dict(k=write(cache["k"], positions, k), v=write(cache["v"], positions, v))
    scores = jnp.einsum("bqhd,bshd->bhqs", q, cache["k"]) / np.sqrt(D // HEADS)
    visible = jnp.arange(cache["k"].shape[1])[None, None, :] <= positions[:, :, None]
    scores = jnp.where(visible[:, None], scores, -1e30)
    x = x + jnp.einsum("bhqs,bshd->bqhd", jax.nn.softmax(scores, -1), cache["v"]).reshape(b, n, D) @ p["out"]
    return x + jax.nn.gelu(_norm(x) @ p["up"]) @ p["down"], cache


def decode_step(layers: int, n_stages: int):
    """The step with `n_stages - 1` markers, blocks split evenly."""
    ends = {round(layers * (s + 1) / n_stages) - 1 for s in range(n_stages - 1)}

    def step(params, cache, tokens, positions):
        x = params["embed"][tokens] + params["pos"][positions]
        new = []
        for i, p in enumerate(params["blocks"]):
            x, c = _block(p, cache[i], x, positions)
            new.append(c)
            if i in ends:
                x = mp.sxstage_iter(x)
        return _norm(x) @ params["embed"].T, new

    return step


def unsplit_generate(step, params, cache, prompt, steps: int):
    """Greedy tokens `(batch, steps)` of the step on one device (all prompts of one length)."""
    batch, length = prompt.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    tokens, out = prompt, []
    for t in range(steps):
        logits, cache = step(params, cache, tokens, positions)
        tokens = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
        out.append(tokens[:, 0])
        positions = jnp.full((batch, 1), length + t, jnp.int32)
    return jnp.stack(out, axis=1)
