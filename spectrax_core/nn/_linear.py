"""Linear layer: y = x @ W + b."""

from __future__ import annotations

from typing import Any, Unpack

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ..init import initialize, lecun_normal, zeros
from ._options import ParamOptions, option_values, with_options


class Linear(eqx.Module):
    """Parameters of an affine map from `d_in` to `d_out` features.

    `axes` names the logical sharding axes of `weight` (`(in, out)`); the bias
    takes the output axis. Override it per use (an attention output projection
    is `("HEAD", "EMBED")`). `compute_dtype` (None: as given) casts the input
    and parameters before the product.
    """

    weight: Float[Array, "d_in d_out"]
    bias: Float[Array, " d_out"] | None
    d_in: int = eqx.field(static=True)
    d_out: int = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("EMBED", "MLP"))
    compute_dtype: Any = eqx.field(static=True, default=None)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_in: int,
        d_out: int,
        *,
        use_bias: bool = True,
        axes: tuple[str | None, str | None] = ("EMBED", "MLP"),
        **options: Unpack[ParamOptions],
    ) -> "Linear":
        """Lecun-normal weight from `key` and zero bias, unless `w_init` / `b_init` (initializers
        `(key, shape, dtype)`; the bias draws from `fold_in(key, 1)`) say otherwise. `dtype` is
        the parameters' dtype."""
        dtype, w_init, b_init, compute_dtype = option_values(options)
        weight = initialize(w_init or lecun_normal(), key, (d_in, d_out), dtype, where="Linear: w_init")
        bias = None
        if use_bias:
            bias = initialize(
                b_init or zeros, jax.random.fold_in(key, 1), (d_out,), dtype, where="Linear: b_init"
            )
        return cls(
            weight=weight, bias=bias, d_in=d_in, d_out=d_out, axes=tuple(axes), compute_dtype=compute_dtype
        )

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"weight": self.axes, "bias": (self.axes[1],)}


@typechecked
def _linear(params: Linear, x: Float[Array, "*batch d_in"]) -> Float[Array, "*batch d_out"]:
    weight, bias = params.weight, params.bias
    if params.compute_dtype is not None:
        x, weight = x.astype(params.compute_dtype), weight.astype(params.compute_dtype)
        bias = None if bias is None else bias.astype(params.compute_dtype)
    y = x @ weight
    if bias is not None:
        y = y + bias
    return y


@register_apply(Linear)
def apply_linear(params: Linear, x: Array) -> Array:
    """Apply a `Linear` to `x` of shape `(..., d_in)`, giving `(..., d_out)`."""
    check_last_dim("Linear", x, params.d_in)
    return _linear(params, x)
