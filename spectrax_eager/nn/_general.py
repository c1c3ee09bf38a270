"""Eager general linear maps: Einsum, DenseGeneral, Bilinear (math in `spectrax_core.nn._einsum`)."""

from __future__ import annotations

from typing import Any, Sequence

import jax

import spectrax_core as sc

from .._graph.rngs import Rngs
from .._scope.lazy import building_lazily, check_may_materialize
from ._base import PARAM_DTYPE, CoreLayer, annotate, dtype_kwargs, key_from, sharding_axes


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
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
        bias_sharding: Any = None,
    ):
        if isinstance(shape, str):
            equation, shape = shape, equation
        if use_bias and bias_shape is None:
            raise ValueError(
                f"Einsum({equation!r}): use_bias=True needs bias_shape= (the trailing output axes the bias "
                "spans), e.g. bias_shape=(heads, head_dim)."
            )
        axes = sharding_axes("Einsum", sharding, len(tuple(shape)), w_init)
        self._adopt(
            sc.nn.Einsum.init(
                key_from(rngs, "Einsum"),
                shape,
                equation,
                bias_shape=None if use_bias is False else bias_shape,
                axes=axes,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )
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
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
        in_shape: int | Sequence[int] | None = None,
        bias_sharding: Any = None,
    ):
        if out_features is not None:
            if in_shape is not None:
                raise TypeError(
                    "DenseGeneral: give (in_features, out_features) or (features, in_shape=), not both."
                )
            features, in_shape = out_features, features
        kw = dict(axis=axis, use_bias=use_bias, **dtype_kwargs(dtype, param_dtype, w_init, b_init))
        self.features, self.pending = features, (tuple(kw.items()), sharding, bias_sharding, w_init)
        self.explicit_lazy = in_shape is None and building_lazily()
        key_from(rngs, "DenseGeneral")  # fail now, not at the first call, when rngs is missing
        self.rngs = rngs
        if in_shape is not None:
            self._build(in_shape)

    def _build(self, in_shape: int | Sequence[int]) -> None:
        check_may_materialize(self.explicit_lazy, "DenseGeneral(features)")
        kw, sharding, bias_sharding, w_init = self.pending
        n_in = 1 if isinstance(in_shape, int) else len(tuple(in_shape))
        n_out = 1 if isinstance(self.features, int) else len(tuple(self.features))
        axes = sharding_axes("DenseGeneral", sharding, n_in + n_out, w_init)
        params = sc.nn.DenseGeneral.init(
            key_from(self.rngs, "DenseGeneral"), in_shape, self.features, axes=axes, **dict(kw)
        )
        for name in ("pending", "rngs", "features", "explicit_lazy"):
            delattr(self, name)
        self._adopt(params)
        annotate(self, "DenseGeneral", bias=bias_sharding)

    def forward(self, x: jax.Array) -> jax.Array:
        if "pending" in self.__dict__:
            axis = dict(self.pending[0])["axis"]
            axes = (axis,) if isinstance(axis, int) else tuple(axis)
            self._build(tuple(x.shape[a] for a in axes))
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
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        sharding: Any = None,
        bias_sharding: Any = None,
    ):
        self._adopt(
            sc.nn.Bilinear.init(
                key_from(rngs, "Bilinear"),
                in1_features,
                in2_features,
                out_features,
                use_bias=use_bias,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )
        annotate(self, "Bilinear", weight=sharding, bias=bias_sharding)

    def forward(self, x1: jax.Array, x2: jax.Array) -> jax.Array:
        return sc.apply(self.core_params(), x1, x2)
