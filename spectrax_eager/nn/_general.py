"""Eager general linear maps: Einsum, DenseGeneral, Bilinear (math in `spectrax_core.nn._einsum`)."""

from __future__ import annotations

from typing import Any, Sequence

import jax

import spectrax_core as sc

from .._rngs import Rngs
from ._base import PARAM_DTYPE, CoreLayer, dtype_kwargs, key_from, sharding_axes


class Einsum(CoreLayer):
    """`einsum(einsum_str, x, weight) + bias`, weight of shape `shape`, e.g.
    `Einsum((d, heads, head_dim), "btd,dhk->bthk", rngs=rngs)`; a bias when `bias_shape` is given."""

    core_cls = sc.nn.Einsum

    def __init__(
        self,
        shape: Sequence[int],
        einsum_str: str,
        *,
        bias_shape: Sequence[int] | None = None,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
    ):
        axes = sharding_axes("Einsum", sharding, len(tuple(shape)), w_init)
        self._adopt(
            sc.nn.Einsum.init(
                key_from(rngs, "Einsum"),
                shape,
                einsum_str,
                bias_shape=bias_shape,
                axes=axes,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )


class DenseGeneral(CoreLayer):
    """A linear map contracting the input axes `axis` (sizes `in_features`) into output axes of
    sizes `out_features`, appended after the input's remaining axes."""

    core_cls = sc.nn.DenseGeneral

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        sharding: tuple | None = None,
        rngs: Rngs | None = None,
    ):
        n_in = 1 if isinstance(in_features, int) else len(tuple(in_features))
        n_out = 1 if isinstance(out_features, int) else len(tuple(out_features))
        axes = sharding_axes("DenseGeneral", sharding, n_in + n_out, w_init)
        self._adopt(
            sc.nn.DenseGeneral.init(
                key_from(rngs, "DenseGeneral"),
                in_features,
                out_features,
                axis=axis,
                use_bias=use_bias,
                axes=axes,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )


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

    def forward(self, x1: jax.Array, x2: jax.Array) -> jax.Array:
        return sc.apply(self.core_params(), x1, x2)
