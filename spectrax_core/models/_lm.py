"""Decoder-only transformer language model, built from `spectrax_core.nn` layers.

The forward is a composition of three public pieces so a pipeline can cut it
between blocks: `lm_embed` (tokens → residual stream), the blocks
(`apply(lm.blocks, x)` or one `apply(lm.blocks.layer(i), x)` at a time) and
`lm_head` (final norm, then the output projection or the tied embedding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from ..nn._composite import Composite
from .._apply import apply, register_apply
from ..losses import softmax_cross_entropy
from ..nn import BlockStack, Embed, KVCache, Linear, RMSNorm, attend
from ..nn._validate import check_integer, check_ndim


class TransformerLM(Composite):
    """Parameters of a decoder-only LM: `embed`, stacked `blocks`, final `norm`, `head`.

    `head` is None when the output projection is tied to the embedding table.
    """

    embed: Embed
    blocks: BlockStack
    norm: RMSNorm
    head: Linear | None
    vocab_size: int = eqx.field(static=True)
    d_model: int = eqx.field(static=True)

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_ff: int,
        tie_embeddings: bool = False,
        rope: bool = True,
        gated: bool = True,
        dtype=jnp.float32,
    ) -> "TransformerLM":
        """A causal pre-RMSNorm LM: RoPE and SwiGLU blocks by default, no biases.

        With `rope=False` the model has no position signal other than the causal
        mask ("NoPE").
        """

        def build(key: PRNGKeyArray) -> TransformerLM:
            k_embed, k_blocks, k_head = jax.random.split(key, 3)
            sizes = dict(d_model=d_model, n_heads=n_heads, d_ff=d_ff, n_kv_heads=n_kv_heads)
            kind = dict(causal=True, rope=rope, norm="rms", gated=gated, use_bias=False, dtype=dtype)
            blocks = BlockStack.init(k_blocks, n_layers, **sizes, **kind)
            head = None
            if not tie_embeddings:
                head = Linear.init(
                    k_head, d_model, vocab_size, use_bias=False, dtype=dtype, axes=("EMBED", "VOCAB")
                )
            return cls(
                embed=Embed.init(k_embed, vocab_size, d_model, dtype=dtype),
                blocks=blocks,
                norm=RMSNorm.init(None, d_model, dtype=dtype),
                head=head,
                vocab_size=vocab_size,
                d_model=d_model,
            )

        # One compiled program instead of an eager dispatch per initializer op.
        return jax.jit(build)(key)

    @property
    def n_layers(self) -> int:
        """Number of transformer blocks."""
        return self.blocks.n_layers


def _check_tokens(name: str, tokens: Array) -> None:
    check_ndim(name, tokens, 2, "(batch, length)")
    check_integer(name, tokens)


def lm_embed(lm: TransformerLM, tokens: Array) -> Array:
    """Token ids `(batch, length)` → residual stream `(batch, length, d_model)`."""
    _check_tokens("TransformerLM", tokens)
    return apply(lm.embed, tokens)


def lm_head(lm: TransformerLM, x: Array) -> Array:
    """Residual stream `(batch, length, d_model)` → logits `(batch, length, vocab_size)`."""
    h = apply(lm.norm, x)
    return attend(lm.embed, h) if lm.head is None else apply(lm.head, h)


@register_apply(TransformerLM)
def apply_lm(
    lm: TransformerLM, tokens: Array, *, cache: KVCache | None = None
) -> Array | tuple[Array, KVCache]:
    """Causal logits `(batch, length, vocab_size)` for token ids `(batch, length)`.

    With `cache` (from `init_cache`) the tokens continue the cached sequence and
    `(logits, new_cache)` is returned: feed a prompt, then one token at a time.
    """
    x = lm_embed(lm, tokens)
    if cache is None:
        return lm_head(lm, apply(lm.blocks, x))
    x, cache = apply(lm.blocks, x, cache=cache)
    return lm_head(lm, x), cache


def init_cache(lm: TransformerLM, batch: int, max_len: int, *, dtype=None) -> KVCache:
    """Empty stacked KV caches for decoding up to `max_len` positions."""
    return lm.blocks.init_cache(batch, max_len, dtype=dtype)


@jax.jit
def _decode_step(lm: TransformerLM, tokens: Array, cache: KVCache) -> tuple[Array, KVCache]:
    return apply(lm, tokens, cache=cache)


def greedy_decode(
    lm: TransformerLM,
    prompt: Array,
    steps: int,
    *,
    max_len: int | None = None,
    step: Callable | None = None,
) -> Array:
    """The `steps` greedy next tokens `(batch, steps)` after `prompt` `(batch, length)`.

    One prefill call feeds the prompt into a fresh KV cache of `max_len`
    positions (default: prompt length + steps); then one call per token.
    `step(tokens, cache) -> (logits, cache)` runs the model (default: this
    model under `jax.jit`); a pipeline passes its own.
    """
    _check_tokens("greedy_decode", prompt)
    batch, length = prompt.shape
    max_len = length + steps if max_len is None else max_len
    if steps < 1 or length + steps > max_len:
        raise ValueError(
            f"greedy_decode: a prompt of {length} tokens plus {steps} new ones needs a cache of "
            f"{length + steps} positions, but max_len is {max_len}; raise max_len or shorten the prompt."
        )
    step = step if step is not None else functools.partial(_decode_step, lm)
    cache = init_cache(lm, batch, max_len)
    logits, cache = step(prompt, cache)
    token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
    tokens = [token]
    for _ in range(steps - 1):
        logits, cache = step(token, cache)
        token = jnp.argmax(logits[:, -1], axis=-1).astype(prompt.dtype)[:, None]
        tokens.append(token)
    return jnp.concatenate(tokens, axis=1)


def lm_loss(lm: TransformerLM, tokens: Array, targets: Array, mask: Array | None = None) -> Array:
    """Mean next-token cross-entropy of `apply(lm, tokens)` against `targets` `(batch, length)`."""
    return softmax_cross_entropy(apply(lm, tokens), targets, mask=mask)
