"""The small model and the training loop the recipe tests share.

A two-stage token model (embedding and a residual layer on the first stage, a
residual layer and the vocabulary head on the second), and `train`, which runs
five steps of a pipelined step and of its unsplit reference on the same data
and compares every step's results.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B, ZeroBubbleH1

VOCAB, WIDTH, LENGTH, BATCH, M, STEPS = 16, 16, 6, 8, 4, 5
SCHEDULES = {"Std1F1B": Std1F1B(microbatches=M), "ZeroBubbleH1": ZeroBubbleH1(microbatches=M)}
MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def init(key) -> dict:
    k = jax.random.split(key, 4)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, WIDTH)) * 0.5,
        "w1": jax.random.normal(k[1], (WIDTH, WIDTH)) * 0.3,
        "w2": jax.random.normal(k[2], (WIDTH, WIDTH)) * 0.3,
        "head": jax.random.normal(k[3], (WIDTH, VOCAB)) * 0.3,
    }


def logits(p, tokens, mix=None):
    """`[batch, length, vocab]`; `mix` (`[batch, length, length]`) averages positions in the
    first stage (the attention of a packed batch)."""
    h = p["embed"][tokens]
    if mix is not None:
        h = h + jnp.einsum("bqk,bkd->bqd", mix, h)
    h = h + jnp.tanh(h @ p["w1"])
    h = mp.sxstage_iter(h)
    h = h + jnp.tanh(h @ p["w2"])
    return h @ p["head"]


def token_losses(p, tokens, targets, mix=None):
    return optax.softmax_cross_entropy_with_integer_labels(logits(p, tokens, mix), targets)


def batches(seed: int = 0) -> list:
    """`STEPS` batches of `(tokens, targets)`."""
    keys = jax.random.split(jax.random.key(seed), STEPS)
    out = []
    for key in keys:
        data = jax.random.randint(key, (BATCH, LENGTH + 1), 0, VOCAB)
        out.append((data[:, :-1], data[:, 1:]))
    return out


def close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol), got, want)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def train(pipelined, reference, state: tuple, data: list, compare=close) -> None:
    """Run both steps `STEPS` times from `state` (`step(*state, *batch) -> (outputs, *state)`):
    the pipelined one on copies (it may donate them), each step's outputs compared."""
    ours, theirs = copy(state), state
    for batch in data:
        got = pipelined(*ours, *batch)
        want = reference(*theirs, *batch)
        compare(got, want)
        ours, theirs = got[1:], want[1:]
