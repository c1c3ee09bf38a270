"""A heterogeneous pipeline for the planner's tests: an embedding, one wide block, narrow blocks,
a head with its loss; `lm_loss(n_stages)` cuts it into any number of stages up to its 8 blocks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spectrax_mpmd as mp

VOCAB, D, LENGTH, BATCH, M = 32, 16, 8, 32, 8
HIDDEN = (128, 16, 16, 16, 16, 16, 16, 16)  # one wide block, then narrow ones
MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])


def residual_mlp_lm(widths, *, d: int, vocab: int, batch: int, length: int, scale: float):
    """`(params, tokens, targets)`: an embedding, one residual MLP block per width (hidden width
    `widths[k]`, weights ~ N(0, 1) / scale) and a head, with a random token batch."""
    keys = jax.random.split(jax.random.key(0), 2 * len(widths) + 4)
    blocks = [
        {
            "w1": jax.random.normal(keys[2 * k], (d, h)) / scale,
            "w2": jax.random.normal(keys[2 * k + 1], (h, d)) / scale,
        }
        for k, h in enumerate(widths)
    ]
    params = {
        "embed": jax.random.normal(keys[-4], (vocab, d)) / 10,
        "blocks": blocks,
        "head": jax.random.normal(keys[-3], (d, vocab)) / 10,
    }
    tokens = jax.random.randint(keys[-2], (batch, length), 0, vocab)
    targets = jax.random.randint(keys[-1], (batch, length), 0, vocab)
    return params, tokens, targets


def init():
    return residual_mlp_lm(HIDDEN, d=D, vocab=VOCAB, batch=BATCH, length=LENGTH, scale=4)


def lm_loss(n_stages: int):
    """Embedding and the first blocks on stage 0, the head and loss on the last stage."""
    return residual_lm_loss(mp.stage_sizes(len(HIDDEN), n_stages))


def residual_lm_loss(sizes):
    """The residual-MLP LM's loss with a stage marker after the last block of each of `sizes`'
    stages (block counts)."""
    ends = set(np.cumsum(sizes)[:-1].tolist())

    def loss(params, tokens, targets):
        x = params["embed"][tokens]
        for k, block in enumerate(params["blocks"]):
            x = x + jnp.tanh(x @ block["w1"]) @ block["w2"]
            if k + 1 in ends:
                x = mp.sxstage_iter(x)
        logp = jax.nn.log_softmax(x @ params["head"])
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return loss


@functools.cache
def profiled(schedule, remat: bool = False):
    """`(step, args, outputs, profile, measured peak bytes)` of `lm_loss` under `schedule` on MESH:
    one build per configuration for the whole session; `outputs` from a plain step before the
    profile and the measurement ran."""
    step = mp.sxvalue_and_grad(
        lm_loss(schedule.num_model_stages(4)), mesh=MESH, schedule=schedule, remat=remat
    )
    args = init()
    outputs = step(*args)
    profile = step.profile_stages(*args, rounds=1)
    return step, args, outputs, profile, step.measure_peak_bytes(*args)


TXS = {
    "clip+adamw": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "adamw": optax.adamw(1e-2),
    "momentum": optax.sgd(0.1, momentum=0.9),
}


@functools.cache
def measured_with_update(schedule, tx_name: str):
    """The per-rank peak bytes of `lm_loss`'s whole training step (`sxvalue_and_grad_and_apply`
    with `TXS[tx_name]`) under `schedule` on MESH, its optimizer state included."""
    tx = TXS[tx_name]
    step = mp.sxvalue_and_grad_and_apply(
        lm_loss(schedule.num_model_stages(4)), tx, mesh=MESH, schedule=schedule
    )
    params, tokens, targets = init()
    return step.measure_peak_bytes(params, tx.init(params), tokens, targets)
