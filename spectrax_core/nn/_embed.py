"""Token embedding: a lookup table, and `attend` to reuse it as a tied output head."""

from __future__ import annotations

from typing import Any, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ..init import initialize
from ._options import WeightOptions, option_values, with_options
from ._validate import check_integer


class Embed(eqx.Module):
    """Parameters of a `vocab_size × d_model` embedding table; `compute_dtype` (None: the
    table's) casts the looked-up rows and the table in `attend`."""

    table: Float[Array, "vocab d_model"]
    vocab_size: int = eqx.field(static=True)
    d_model: int = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True, default=None)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("VOCAB", "EMBED"))

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        vocab_size: int,
        d_model: int,
        *,
        axes: tuple[str | None, str | None] = ("VOCAB", "EMBED"),
        **options: Unpack[WeightOptions],
    ) -> "Embed":
        """Normal table with standard deviation `1/sqrt(d_model)` (unit-norm rows on average),
        unless `w_init` (an initializer `(key, shape, dtype)`) says otherwise."""
        dtype, w_init, _, compute_dtype = option_values(options)
        if w_init is None:
            table = jax.random.normal(key, (vocab_size, d_model), dtype) * d_model**-0.5
        else:
            table = initialize(w_init, key, (vocab_size, d_model), dtype, where="Embed: w_init")
        return cls(
            table=table, vocab_size=vocab_size, d_model=d_model, compute_dtype=compute_dtype, axes=tuple(axes)
        )

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"table": self.axes}


@typechecked
def _embed(
    table: Float[Array, "vocab d_model"], tokens: Int[Array, "*batch"]
) -> Float[Array, "*batch d_model"]:
    return jnp.take(table, tokens, axis=0)


@typechecked
def _attend(
    table: Float[Array, "vocab d_model"], x: Float[Array, "*batch d_model"]
) -> Float[Array, "*batch vocab"]:
    return x @ table.T


@register_apply(Embed)
def apply_embed(params: Embed, tokens: Array) -> Array:
    """Look up integer `tokens` of any shape, giving `tokens.shape + (d_model,)`.

    Ids follow NumPy indexing (a negative id counts from the end); ids outside
    `[-vocab_size, vocab_size)` give NaN rows (`jnp.take`'s fill mode), not a silent clamp.
    """
    check_integer("Embed", tokens)
    table = params.table if params.compute_dtype is None else params.table.astype(params.compute_dtype)
    return _embed(table, tokens)


def attend(params: Embed, x: Array) -> Array:
    """Logits `x @ table.T` of shape `(..., vocab_size)`: the embedding used as a tied head."""
    check_last_dim("Embed.attend", x, params.d_model)
    if params.compute_dtype is not None:
        return _attend(params.table.astype(params.compute_dtype), x.astype(params.compute_dtype))
    return _attend(params.table, x)
