"""Eager layers over `spectrax_core.nn`: each `__init__` is the core `init`, each call is `sc.apply`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import spectrax_core as sc

from .._rngs import Rngs
from ._base import CoreLayer, key_from


class Linear(CoreLayer):
    """`y = x @ weight + bias`; `Linear(None, d_out, rngs=rngs)` infers `d_in` on the first call.

    A lazy layer keeps `rngs` and creates its Parameters on its first (eager)
    call; call the model once before a transform.
    """

    core_cls = sc.nn.Linear

    def __init__(
        self,
        d_in: int | None,
        d_out: int,
        *,
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple = ("EMBED", "MLP"),
        rngs: Rngs | None = None,
    ):
        if d_in is None:
            self.d_out, self.use_bias, self.dtype, self.axes, self.rngs = (
                d_out,
                use_bias,
                dtype,
                tuple(axes),
                rngs,
            )
            self.d_in = None
            key_from(rngs, "Linear(None, ...)")  # fail now, not at the first call, when rngs is missing
            return
        self._adopt(
            sc.nn.Linear.init(
                key_from(rngs, "Linear"), d_in, d_out, use_bias=use_bias, dtype=dtype, axes=axes
            )
        )

    def forward(self, x: jax.Array) -> jax.Array:
        if self.d_in is None:
            params = sc.nn.Linear.init(
                self.rngs.params(),
                x.shape[-1],
                self.d_out,
                use_bias=self.use_bias,
                dtype=self.dtype,
                axes=self.axes,
            )
            for name in ("use_bias", "dtype", "rngs"):
                delattr(self, name)
            self._adopt(params)
        return super().forward(x)


class Embed(CoreLayer):
    """Token embedding table `(vocab_size, d_model)`; `attend(x)` is the tied output head."""

    core_cls = sc.nn.Embed

    def __init__(self, vocab_size: int, d_model: int, *, dtype=jnp.float32, rngs: Rngs | None = None):
        self._adopt(sc.nn.Embed.init(key_from(rngs, "Embed"), vocab_size, d_model, dtype=dtype))

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits `x @ table.T`."""
        return sc.nn.attend(self.core_params(), x)


class LayerNorm(CoreLayer):
    """Layer normalisation over the last axis (scale and bias)."""

    core_cls = sc.nn.LayerNorm

    def __init__(self, d: int, *, eps: float = 1e-5, dtype=jnp.float32, rngs: Rngs | None = None):
        self._adopt(sc.nn.LayerNorm.init(None, d, eps=eps, dtype=dtype))


class RMSNorm(CoreLayer):
    """RMS normalisation over the last axis (scale only)."""

    core_cls = sc.nn.RMSNorm

    def __init__(self, d: int, *, eps: float = 1e-6, dtype=jnp.float32, rngs: Rngs | None = None):
        self._adopt(sc.nn.RMSNorm.init(None, d, eps=eps, dtype=dtype))


class Dropout(CoreLayer):
    """Dropout with rate `rate`; active in `train()` mode, drawing keys from `rngs.dropout()`."""

    core_cls = sc.nn.Dropout

    def __init__(self, rate: float, *, rngs: Rngs | None = None):
        self._adopt(sc.nn.Dropout.init(None, rate))
        self.rngs = rngs

    def forward(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        det = (not self.training) if deterministic is None else deterministic
        if det or self.rate == 0.0:
            return x
        if self.rngs is None:
            raise ValueError(
                "Dropout: training mode needs rngs=spx.Rngs(...) at construction "
                "(or call model.eval() / pass deterministic=True)."
            )
        return sc.apply(self.core_params(), x, key=self.rngs.dropout(), deterministic=False)


class MLP(CoreLayer):
    """`down(activation(up(x)))`, `d_model → d_ff → d_model`."""

    core_cls = sc.nn.MLP

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        use_bias: bool = True,
        dtype=jnp.float32,
        rngs: Rngs | None = None,
    ):
        self._adopt(
            sc.nn.MLP.init(
                key_from(rngs, "MLP"), d_model, d_ff, activation=activation, use_bias=use_bias, dtype=dtype
            )
        )


class GatedMLP(CoreLayer):
    """`down(activation(gate(x)) * up(x))` (SwiGLU by default)."""

    core_cls = sc.nn.GatedMLP

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "silu",
        use_bias: bool = False,
        dtype=jnp.float32,
        rngs: Rngs | None = None,
    ):
        self._adopt(
            sc.nn.GatedMLP.init(
                key_from(rngs, "GatedMLP"),
                d_model,
                d_ff,
                activation=activation,
                use_bias=use_bias,
                dtype=dtype,
            )
        )


class Attention(CoreLayer):
    """Multi-head self-attention (causal by default, grouped-query heads, optional RoPE).

    Call as `attn(x, mask=None)` on `(batch, length, d_model)`; with `cache=`
    (a core `KVCache`) it returns `(y, new_cache)`.
    """

    core_cls = sc.nn.Attention

    def __init__(self, d_model: int, n_heads: int, *, rngs: Rngs | None = None, **kwargs: Any):
        self._adopt(sc.nn.Attention.init(key_from(rngs, "Attention"), d_model, n_heads, **kwargs))


class Block(CoreLayer):
    """Pre-norm transformer block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.

    Keyword arguments are those of `spectrax_core.nn.Block.init` (`n_kv_heads`,
    `rope`, `norm="rms"`, `gated=True`, ...).
    """

    core_cls = sc.nn.Block

    def __init__(self, d_model: int, n_heads: int, d_ff: int, *, rngs: Rngs | None = None, **kwargs: Any):
        self._adopt(sc.nn.Block.init(key_from(rngs, "Block"), d_model, n_heads, d_ff, **kwargs))


class Conv1d(CoreLayer):
    """1-d convolution over `(batch, length, c_in)` (channels last)."""

    core_cls = sc.nn.Conv1d

    def __init__(
        self, c_in: int, c_out: int, kernel_size: int | tuple[int], *, rngs: Rngs | None = None, **kwargs: Any
    ):
        self._adopt(sc.nn.Conv1d.init(key_from(rngs, "Conv1d"), c_in, c_out, kernel_size, **kwargs))


class Conv2d(CoreLayer):
    """2-d convolution over `(batch, height, width, c_in)` (channels last)."""

    core_cls = sc.nn.Conv2d

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int | tuple[int, int],
        *,
        rngs: Rngs | None = None,
        **kwargs: Any,
    ):
        self._adopt(sc.nn.Conv2d.init(key_from(rngs, "Conv2d"), c_in, c_out, kernel_size, **kwargs))
