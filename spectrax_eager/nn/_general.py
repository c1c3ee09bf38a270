"""Eager general linear maps: Einsum, DenseGeneral, Bilinear (math in `spectrax_core.nn._einsum`)."""

from __future__ import annotations

from typing import Any, Sequence, Unpack

import jax

import spectrax_core as sc

from .._scope.lazy import building_lazily, check_may_materialize
from ._base import CoreLayer, LayerOptions, annotate, key_from, sharding_axes


class Einsum(CoreLayer):
    """`einsum(equation, x, weight) + bias`, weight of shape `shape`, e.g.
    `Einsum("btd,dhk->bthk", (d, heads, head_dim), rngs=rngs)` (the order `(shape, equation)` is
    accepted too); a bias of shape `bias_shape` when it is given (or `use_bias=True` with it)."""

    core_cls = sc.nn.Einsum

    def __init__(
        self,
        equation: str | Sequence[int],
        shape: Sequence[int] | str,
        *,
        use_bias: bool | None = None,
        bias_shape: Sequence[int] | None = None,
        sharding: tuple | None = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        if isinstance(shape, str):
            equation, shape = shape, equation
        if use_bias and bias_shape is None:
            raise ValueError(
                f"Einsum({equation!r}): use_bias=True needs bias_shape= (the trailing output axes the bias "
                "spans), e.g. bias_shape=(heads, head_dim)."
            )
        axes = sharding_axes("Einsum", sharding, len(tuple(shape)), options.get("w_init"))
        bias_shape = None if use_bias is False else bias_shape
        self._build(shape, equation, bias_shape=bias_shape, axes=axes, options=options)
        annotate(self, "Einsum", bias=bias_sharding)


class DenseGeneral(CoreLayer):
    """A linear map contracting the input axes `axis` into output axes of sizes `features`,
    appended after the input's remaining axes.

    `DenseGeneral(features, in_shape=sizes)` gives the contracted sizes; without `in_shape` they are
    read from the first (eager) call. `DenseGeneral(in_features, out_features)` is the same
    as `DenseGeneral(out_features, in_shape=in_features)`.
    """

    core_cls = sc.nn.DenseGeneral

    def __init__(
        self,
        features: int | Sequence[int],
        out_features: int | Sequence[int] | None = None,
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        sharding: tuple | None = None,
        in_shape: int | Sequence[int] | None = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        if out_features is not None:
            if in_shape is not None:
                raise TypeError(
                    "DenseGeneral: give (in_features, out_features) or (features, in_shape=), not both."
                )
            features, in_shape = out_features, features
        self.rngs = options.pop("rngs", None)
        kw = dict(axis=axis, use_bias=use_bias)
        self.features, self.pending = features, (tuple(kw.items()), options, sharding, bias_sharding)
        self.explicit_lazy = in_shape is None and building_lazily()
        key_from(self.rngs, "DenseGeneral")  # fail now, not at the first call, when rngs is missing
        if in_shape is not None:
            self._materialize(in_shape)

    def _materialize(self, in_shape: int | Sequence[int]) -> None:
        check_may_materialize(self.explicit_lazy, "DenseGeneral(features)")
        kw, options, sharding, bias_sharding = self.pending
        n_in = 1 if isinstance(in_shape, int) else len(tuple(in_shape))
        n_out = 1 if isinstance(self.features, int) else len(tuple(self.features))
        axes = sharding_axes("DenseGeneral", sharding, n_in + n_out, options.get("w_init"))
        features, options = self.features, {**options, "rngs": self.rngs}
        for name in ("pending", "rngs", "features", "explicit_lazy"):
            delattr(self, name)
        self._build(in_shape, features, axes=axes, options=options, **dict(kw))
        annotate(self, "DenseGeneral", bias=bias_sharding)

    def forward(self, x: jax.Array) -> jax.Array:
        if "pending" in self.__dict__:
            axis = dict(self.pending[0])["axis"]
            axes = (axis,) if isinstance(axis, int) else tuple(axis)
            self._materialize(tuple(x.shape[a] for a in axes))
        return super().forward(x)


class Bilinear(CoreLayer):
    """`y_k = x1ᵀ W_k x2 + b_k`; call as `layer(x1, x2)` with `(..., in1)` and `(..., in2)`."""

    core_cls = sc.nn.Bilinear

    def __init__(
        self,
        in1_features: int,
        in2_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        sharding: Any = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        self._build(in1_features, in2_features, out_features, use_bias=use_bias, options=options)
        annotate(self, "Bilinear", weight=sharding, bias=bias_sharding)

    def forward(self, x1: jax.Array, x2: jax.Array) -> jax.Array:
        return sc.apply(self.core_params(), x1, x2)
