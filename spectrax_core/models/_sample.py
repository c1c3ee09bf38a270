"""Token sampling for generation: greedy, temperature, top-k and top-p with one PRNG key per sequence.

`Sampler` holds the (static) settings; `GenState` the per-sequence state that
travels with a batch while it decodes: its keys, how many tokens it has
produced, which sequences are finished, their token budgets and the stop
tokens. `next_tokens` turns the last position's logits into the next tokens
and the next state. Token `t` of sequence `b` draws with
`jax.random.fold_in(keys[b], t)`, so a sequence's tokens depend only on its own
key, whatever batch or group it is decoded in.
"""

from __future__ import annotations

from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen from the logits.

    `temperature == 0` is greedy (argmax; `top_k` / `top_p` then change
    nothing). Otherwise the logits are divided by `temperature`, cut to the
    `top_k` largest (if given) and to the smallest set whose probability
    reaches `top_p` (if given), and one token is drawn.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"Sampler: temperature must be >= 0 (0 = greedy), received {self.temperature}.")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"Sampler: top_k must be an int >= 1 or None, received {self.top_k!r}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"Sampler: top_p must be in (0, 1] or None, received {self.top_p!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class GenState(eqx.Module):
    """Per-sequence decoding state: `step` tokens produced so far, `done` sequences, and their settings."""

    step: Int[Array, ""]
    done: Bool[Array, " batch"]
    keys: Array  # typed PRNG keys, one per sequence
    max_new: Int[Array, " batch"]
    stop: Int[Array, " stops"]


def gen_state(batch: int, max_new_tokens, keys=None, stop_tokens=()) -> GenState:
    """The state before the first token: `max_new_tokens` an int or one per sequence, keys one per sequence.

    `keys` may be typed keys `(batch,)` or raw `uint32` key data `(batch, 2)`;
    None gives `jax.random.key(b)` for sequence `b` (only greedy ignores them).
    """
    max_new = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,))
    if max_new.min() < 1:
        raise ValueError(
            f"max_new_tokens must be >= 1 for every sequence, received {max_new.tolist()}; "
            "drop a sequence from the batch instead of asking it for no tokens."
        )
    if keys is None:
        keys = jax.random.split(jax.random.key(0), batch)
    elif not jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)
    if keys.shape != (batch,):
        raise ValueError(
            f"keys must hold one PRNG key per sequence (shape ({batch},) of typed keys or ({batch}, 2) "
            f"of uint32 key data), received shape {keys.shape}; split one key with jax.random.split(key, {batch})."
        )
    stop = np.asarray(stop_tokens, np.int32).reshape(-1)
    return GenState(
        step=jnp.zeros((), jnp.int32),
        done=jnp.zeros((batch,), bool),
        keys=keys,
        max_new=jnp.asarray(max_new),
        stop=jnp.asarray(stop),
    )


def sample_tokens(
    logits: Float[Array, "batch vocab"], keys: Array, step: Int[Array, ""], sampler: Sampler
) -> Int[Array, " batch"]:
    """One token per sequence from `logits`, drawn with `fold_in(keys[b], step)` (see `Sampler`)."""
    if sampler.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits.astype(jnp.float32) / sampler.temperature
    if sampler.top_k is not None and sampler.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, sampler.top_k)[0][:, -1:]
        z = jnp.where(z < kth, -jnp.inf, z)
    if sampler.top_p is not None and sampler.top_p < 1:
        ordered = jnp.sort(z, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < sampler.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z < cutoff, -jnp.inf, z)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
    return jax.vmap(jax.random.categorical)(step_keys, z).astype(jnp.int32)


def next_tokens(
    logits: Float[Array, "batch vocab"], state: GenState, sampler: Sampler, pad_id: int
) -> tuple[Int[Array, " batch"], GenState]:
    """The next token of each sequence (`pad_id` once it is finished) and the state after it.

    A sequence finishes after emitting a stop token or its `max_new` tokens.
    """
    token = jnp.where(state.done, pad_id, sample_tokens(logits, state.keys, state.step, sampler))
    stopped = jnp.any(token[:, None] == state.stop[None, :], axis=-1)
    done = state.done | stopped | (state.step + 1 >= state.max_new)
    return token, eqx.tree_at(lambda s: (s.step, s.done), state, (state.step + 1, done))
