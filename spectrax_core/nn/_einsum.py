"""General linear maps: Einsum (a weight of any shape applied by an einsum formula),
DenseGeneral (contract several input axes, produce several output axes) and Bilinear
(`y_k = x1ᵀ W_k x2 + b_k`)."""

from __future__ import annotations

import math
from typing import Any, Sequence, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim
from ..init import initialize, lecun_normal, variance_scaling, zeros
from ._options import ParamOptions, option_values, with_options


def _bias(key, use_bias, shape, dtype, b_init, where):
    if not use_bias:
        return None
    return initialize(b_init or zeros, jax.random.fold_in(key, 1), shape, dtype, where=f"{where}: b_init")


def _cast(compute_dtype: Any, *arrays):
    if compute_dtype is None:
        return arrays
    return tuple(None if a is None else a.astype(compute_dtype) for a in arrays)


class Einsum(eqx.Module):
    """Parameters of `einsum(formula, x, weight) + bias`, e.g. `"btd,dhk->bthk"` with `shape=(d, h, k)`.

    `axes` names the logical axes of `weight` (one token or None per axis);
    the bias (shape `bias_shape`, broadcast against the output's trailing
    axes) takes the trailing ones.
    """

    weight: Float[Array, "..."]
    bias: Float[Array, "..."] | None
    formula: str = eqx.field(static=True)
    axes: tuple[str | None, ...] = eqx.field(static=True, default=())
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        shape: Sequence[int],
        formula: str,
        *,
        bias_shape: Sequence[int] | None = None,
        axes: Sequence[str | None] | None = None,
        **options: Unpack[ParamOptions],
    ) -> "Einsum":
        """Lecun-normal weight (fan-in on axis -2, fan-out on axis -1) and, with `bias_shape`, a zero bias."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        shape = tuple(shape)
        operands = formula.replace(" ", "").split("->")[0].split(",")
        if "->" not in formula or len(operands) != 2 or len(operands[1].replace("...", "")) != len(shape):
            raise ValueError(
                f"Einsum: formula {formula!r} must read 'x_axes,weight_axes->out_axes' with one weight "
                f"letter per axis of shape {shape}."
            )
        axes = (None,) * len(shape) if axes is None else tuple(axes)
        if len(axes) != len(shape):
            raise ValueError(f"Einsum: axes {axes} must name one token (or None) per weight axis {shape}.")
        weight = initialize(w_init or lecun_normal(), key, shape, dtype, where="Einsum: w_init")
        use_bias = bias_shape is not None
        bias = _bias(key, use_bias, tuple(bias_shape or ()), dtype, b_init, "Einsum")
        return cls(weight=weight, bias=bias, formula=formula, axes=axes, compute_dtype=compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        out = {"weight": self.axes}
        if self.bias is not None:
            out["bias"] = self.axes[len(self.axes) - self.bias.ndim :] if self.bias.ndim else ()
        return out


@register_apply(Einsum)
def apply_einsum(params: Einsum, x: Array) -> Array:
    """`einsum(params.formula, x, weight) (+ bias)`."""
    x, weight, bias = _cast(params.compute_dtype, x, params.weight, params.bias)
    y = jnp.einsum(params.formula, x, weight)
    return y if bias is None else y + bias


class DenseGeneral(eqx.Module):
    """Parameters of a linear map contracting the input axes `axis` (sizes `in_features`) into
    output axes of sizes `out_features`; weight `(*in_features, *out_features)`.

    The output keeps the input's other axes in order, followed by the `out_features` axes.
    """

    weight: Float[Array, "..."]
    bias: Float[Array, "..."] | None
    in_features: tuple[int, ...] = eqx.field(static=True)
    out_features: tuple[int, ...] = eqx.field(static=True)
    axis: tuple[int, ...] = eqx.field(static=True)
    axes: tuple[str | None, ...] = eqx.field(static=True, default=())
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        axes: Sequence[str | None] | None = None,
        **options: Unpack[ParamOptions],
    ) -> "DenseGeneral":
        """Weight initialised as the `(prod(in), prod(out))` matrix (lecun-normal by default) then
        reshaped, so fan-in counts every contracted axis; zero bias of shape `out_features`."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        ins = (in_features,) if isinstance(in_features, int) else tuple(in_features)
        outs = (out_features,) if isinstance(out_features, int) else tuple(out_features)
        axis_t = (axis,) if isinstance(axis, int) else tuple(axis)
        if len(axis_t) != len(ins):
            raise ValueError(
                f"DenseGeneral: axis {axis_t} must list one input axis per in_features entry {ins}."
            )
        axes_t = (None,) * (len(ins) + len(outs)) if axes is None else tuple(axes)
        if len(axes_t) != len(ins) + len(outs):
            raise ValueError(
                f"DenseGeneral: axes {axes_t} must name one token (or None) per weight axis {(*ins, *outs)}."
            )
        flat = initialize(
            w_init or lecun_normal(),
            key,
            (math.prod(ins), math.prod(outs)),
            dtype,
            where="DenseGeneral: w_init",
        )
        bias = _bias(key, use_bias, outs, dtype, b_init, "DenseGeneral")
        return cls(flat.reshape(*ins, *outs), bias, ins, outs, axis_t, axes_t, compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"weight": self.axes, "bias": self.axes[len(self.in_features) :]}


@register_apply(DenseGeneral)
def apply_dense_general(params: DenseGeneral, x: Array) -> Array:
    """Contract `x`'s `axis` axes with the weight; the output ends with the `out_features` axes."""
    contract = tuple(a % x.ndim if -x.ndim <= a < x.ndim else a for a in params.axis)
    if any(not 0 <= a < x.ndim for a in contract) or len(set(contract)) != len(contract):
        raise ValueError(
            f"DenseGeneral: axis {params.axis} is not a set of distinct axes of an input of rank {x.ndim}."
        )
    got = tuple(x.shape[a] for a in contract)
    if got != params.in_features:
        raise ValueError(
            f"DenseGeneral: input axes {params.axis} have sizes {got}, expected in_features {params.in_features} "
            f"(input shape {tuple(x.shape)})."
        )
    x, weight, bias = _cast(params.compute_dtype, x, params.weight, params.bias)
    dims = ((contract, tuple(range(len(contract)))), ((), ()))
    y = lax.dot_general(x, weight, dims)
    return y if bias is None else y + bias


class Bilinear(eqx.Module):
    """Parameters of `y_k = Σ_ij x1_i · weight[i, j, k] · x2_j + bias_k`; weight `(in1, in2, out)`."""

    weight: Float[Array, "in1 in2 out"]
    bias: Float[Array, " out"] | None
    in1_features: int = eqx.field(static=True)
    in2_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        in1_features: int,
        in2_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        **options: Unpack[ParamOptions],
    ) -> "Bilinear":
        """Lecun-normal weight with fan-in `in1 · in2` (or `w_init`), zero bias (or `b_init`)."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        default = variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=-1)
        shape = (in1_features, in2_features, out_features)
        weight = initialize(w_init or default, key, shape, dtype, where="Bilinear: w_init")
        bias = _bias(key, use_bias, (out_features,), dtype, b_init, "Bilinear")
        return cls(weight, bias, in1_features, in2_features, out_features, compute_dtype)

    def logical_axes(self) -> dict[str, tuple]:
        """Replicated: bilinear forms are small."""
        return {"weight": (None, None, None), "bias": (None,)}


@register_apply(Bilinear)
def apply_bilinear(params: Bilinear, x1: Array, x2: Array) -> Array:
    """`(..., in1)` and `(..., in2)` (same leading shape) to `(..., out)`."""
    check_last_dim("Bilinear", x1, params.in1_features)
    check_last_dim("Bilinear", x2, params.in2_features)
    if x1.shape[:-1] != x2.shape[:-1]:
        raise ValueError(
            f"Bilinear: inputs must share their leading axes, received {tuple(x1.shape)} and {tuple(x2.shape)}."
        )
    x1, x2, weight, bias = _cast(params.compute_dtype, x1, x2, params.weight, params.bias)
    y = jnp.einsum("...i,ijk,...j->...k", x1, weight, x2)
    return y if bias is None else y + bias
