"""Eager layers over `spectrax_core.nn`: each `__init__` is the core `init`, each call is `sc.apply`.

Keywords shared by the layers: `dtype` (compute dtype; None = as given),
`param_dtype` (storage dtype of the parameters, float32), `w_init` / `b_init`
(initializers from `spx.init` or `jax.nn.initializers`), `use_bias`, and
`sharding` (logical axis tokens of the weight, one per axis).
"""

from __future__ import annotations

from typing import Any, Unpack

import jax

import spectrax_core as sc

from .._graph.rngs import Rngs
from .._scope.lazy import building_lazily, check_may_materialize
from ._base import (
    CoreLayer,
    LayerOptions,
    WeightOptions,
    also_named,
    annotate,
    fix_constant,
    key_from,
    sharding_axes,
    split_options,
)


@also_named(in_features="d_in", out_features="d_out")
class Linear(CoreLayer):
    """`y = x @ weight + bias`, weight `(d_in, d_out)`; `Linear(None, d_out, rngs=rngs)` infers
    `d_in` on the first call.

    A lazy layer keeps its settings and `rngs` and creates its Parameters on its
    first (eager) call; call the model once before a transform.
    """

    core_cls = sc.nn.Linear
    use_bias = property(lambda self: self.__dict__.get("bias") is not None, doc="Whether there is a bias.")

    def __init__(
        self,
        d_in: int | None,
        d_out: int,
        *,
        use_bias: bool = True,
        sharding: tuple | None = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        axes = sharding_axes("Linear", sharding, 2, options.get("w_init")) or ("EMBED", "MLP")
        kw = dict(use_bias=use_bias, axes=axes, options=options)
        if d_in is None:
            self.d_out, self.d_in, self.rngs = d_out, None, options.pop("rngs", None)
            self.init_kwargs = (
                *kw.items(),
                ("bias_sharding", bias_sharding),
                ("explicit", building_lazily()),
            )
            key_from(self.rngs, "Linear(None, ...)")  # fail now, not at the first call, when rngs is missing
            return
        self._build(d_in, d_out, **kw)
        annotate(self, "Linear", bias=bias_sharding)

    def forward(self, x: jax.Array) -> jax.Array:
        if self.d_in is None:
            kw = dict(self.init_kwargs)
            check_may_materialize(kw.pop("explicit"), "Linear(None, ...)")
            bias_sharding = kw.pop("bias_sharding")
            kw["options"] = {**kw["options"], "rngs": self.rngs}
            for name in ("init_kwargs", "rngs"):
                delattr(self, name)
            self._build(x.shape[-1], self.d_out, **kw)
            annotate(self, "Linear", bias=bias_sharding)
        return super().forward(x)


@also_named(num_embeddings="vocab_size", features="d_model", weight="table")
class Embed(CoreLayer):
    """Token embedding table `(vocab_size, d_model)`; `attend(x)` is the tied output head."""

    core_cls = sc.nn.Embed

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        sharding: tuple | None = None,
        **options: Unpack[WeightOptions],
    ):
        axes = sharding_axes("Embed", sharding, 2, options.get("w_init"))
        self._build(vocab_size, d_model, options=options, **({} if axes is None else {"axes": axes}))

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits `x @ table.T`."""
        return sc.nn.attend(self.core_params(), x)


@also_named(features="d", weight="scale")
class LayerNorm(CoreLayer):
    """Layer normalisation over the last axis (scale and bias); `rngs` only feeds `w_init` / `b_init`.
    `elementwise_affine=False` (or `use_bias=False`) keeps the scale (bias) at its initial value as
    a `Buffer`, not trained."""

    core_cls = sc.nn.LayerNorm

    def __init__(
        self,
        d: int,
        *,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        use_bias: bool = True,
        sharding: Any = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        self._build(d, eps=eps, options=options, constant=True)
        fix_constant(
            self,
            *(() if elementwise_affine else ("scale",)),
            *(() if use_bias and elementwise_affine else ("bias",)),
        )
        annotate(self, "LayerNorm", scale=sharding, bias=bias_sharding)


@also_named(features="d", weight="scale")
class RMSNorm(CoreLayer):
    """RMS normalisation over the last axis (scale only); `rngs` only feeds `w_init`;
    `elementwise_affine=False` keeps the scale fixed (a `Buffer`)."""

    core_cls = sc.nn.RMSNorm

    def __init__(
        self,
        d: int,
        *,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        sharding: Any = None,
        **options: Unpack[WeightOptions],
    ):
        self._build(d, eps=eps, options=options, constant=True)
        fix_constant(self, *(() if elementwise_affine else ("scale",)))
        annotate(self, "RMSNorm", scale=sharding)


class Dropout(CoreLayer):
    """Dropout with rate `rate`; active in `train()` mode, drawing keys from `rngs.dropout()`."""

    core_cls = sc.nn.Dropout

    def __init__(self, rate: float = 0.5, *, rngs: Rngs | None = None):
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
        **options: Unpack[LayerOptions],
    ):
        self._build(d_model, d_ff, activation=activation, use_bias=use_bias, options=options)


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
        **options: Unpack[LayerOptions],
    ):
        self._build(d_model, d_ff, activation=activation, use_bias=use_bias, options=options)


class Attention(CoreLayer):
    """Multi-head self-attention (causal by default, grouped-query heads, optional RoPE).

    Call as `attn(x, mask=None)` on `(batch, length, d_model)`; with `cache=`
    (a core `KVCache`) it returns `(y, new_cache)`. Other keywords are `LayerOptions` and those of
    `spectrax_core.nn.Attention.init` (`n_kv_heads`, `head_dim`, `causal`, `rope`, ...).
    """

    core_cls = sc.nn.Attention

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        **kwargs: Any,
    ):
        options, kwargs = split_options(kwargs)
        self._build(d_model, n_heads, options=options, **kwargs)


class Block(CoreLayer):
    """Pre-norm transformer block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.

    Other keywords are `LayerOptions` and those of `spectrax_core.nn.Block.init` (`n_kv_heads`,
    `rope`, `norm="rms"`, `gated=True`, ...).
    """

    core_cls = sc.nn.Block

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        **kwargs: Any,
    ):
        options, kwargs = split_options(kwargs)
        self._build(d_model, n_heads, d_ff, options=options, **kwargs)
