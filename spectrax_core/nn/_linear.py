"""Linear layer: y = x @ W + b."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._apply import register_apply
from .._checks import check_last_dim, typechecked


class Linear(eqx.Module):
    """Parameters of an affine map from `d_in` to `d_out` features.

    `axes` names the logical sharding axes of `weight` (`(in, out)`); the bias
    takes the output axis. Override it per use (an attention output projection
    is `("HEAD", "EMBED")`).
    """

    weight: Float[Array, "d_in d_out"]
    bias: Float[Array, " d_out"] | None
    d_in: int = eqx.field(static=True)
    d_out: int = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("EMBED", "MLP"))

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        d_in: int,
        d_out: int,
        *,
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple[str | None, str | None] = ("EMBED", "MLP"),
    ) -> "Linear":
        """Lecun-normal weight, zero bias."""
        weight = jax.nn.initializers.lecun_normal()(key, (d_in, d_out), dtype)
        bias = jnp.zeros((d_out,), dtype) if use_bias else None
        return cls(weight=weight, bias=bias, d_in=d_in, d_out=d_out, axes=tuple(axes))

    def logical_axes(self) -> dict[str, tuple]:
        """Logical axes of each array field (see `spectrax_core.sharding`)."""
        return {"weight": self.axes, "bias": (self.axes[1],)}


@typechecked
def _linear(params: Linear, x: Float[Array, "*batch d_in"]) -> Float[Array, "*batch d_out"]:
    y = x @ params.weight
    if params.bias is not None:
        y = y + params.bias
    return y


@register_apply(Linear)
def apply_linear(params: Linear, x: Array) -> Array:
    """Apply a `Linear` to `x` of shape `(..., d_in)`, giving `(..., d_out)`."""
    check_last_dim("Linear", x, params.d_in)
    return _linear(params, x)
