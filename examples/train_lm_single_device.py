"""Train a tiny decoder-only LM with the functional core: params pytree + optax + jax.jit.

Task: each sequence repeats a random motif of `PERIOD` tokens. After the first
period every next token is determined by the token `PERIOD` positions back, so
the model must learn to look back; the loss is masked to those positions.
At the end the trained model continues a fresh motif token by token with a KV cache.

    python examples/train_lm_single_device.py
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax

import spectrax_core as sc
from spectrax_core.models import TransformerLM, init_cache, lm_loss

VOCAB, PERIOD, LENGTH, BATCH, STEPS = 16, 5, 24, 32, 250


def make_batch(key: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs, next-token targets and the mask of predictable positions."""
    motif = jax.random.randint(key, (BATCH, PERIOD), 0, VOCAB)
    seq = jnp.tile(motif, (1, LENGTH // PERIOD + 2))[:, : LENGTH + 1]
    mask = jnp.broadcast_to(jnp.arange(LENGTH) >= PERIOD - 1, (BATCH, LENGTH))
    return seq[:, :-1], seq[:, 1:], mask


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    steps = parser.parse_args(argv).steps
    key_model, key_data = jax.random.split(jax.random.key(0))
    params = TransformerLM.init(key_model, vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=128)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 5e-3, 20, steps), weight_decay=0.01)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, key):
        tokens, targets, mask = make_batch(key)
        loss, grads = jax.value_and_grad(lm_loss)(params, tokens, targets, mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    for step, key in enumerate(jax.random.split(key_data, steps)):
        params, opt_state, loss = train_step(params, opt_state, key)
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {float(loss):.4f}  ({time.perf_counter() - start:.1f} s)")

    # Greedy continuation of an unseen motif, one token per call through the KV cache.
    decode = jax.jit(lambda p, t, c: sc.apply(p, t, cache=c))
    motif = jax.random.randint(jax.random.key(123), (1, PERIOD), 0, VOCAB)
    cache = init_cache(params, 1, 3 * PERIOD)
    logits, cache = decode(params, motif, cache)
    out = [int(jnp.argmax(logits[0, -1]))]
    for _ in range(2 * PERIOD - 1):
        logits, cache = decode(params, jnp.array([[out[-1]]], jnp.int32), cache)
        out.append(int(jnp.argmax(logits[0, -1])))
    expected = jnp.tile(motif[0], 2).tolist()
    print(f"prompt {motif[0].tolist()}\ngreedy {out}\nexpect {expected}  match: {out == expected}")


if __name__ == "__main__":
    main()
