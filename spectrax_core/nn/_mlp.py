"""Feed-forward layers: MLP (up, activation, down) and GatedMLP (SwiGLU-style)."""

from __future__ import annotations

from typing import Callable, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._composite import Composite
from .._apply import register_apply
from .._checks import check_last_dim, typechecked
from ._linear import Linear, _linear
from ._options import ParamOptions, with_options

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu": jax.nn.gelu,
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
    "sigmoid": jax.nn.sigmoid,
}


def _check_activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not known; choose one of {sorted(ACTIVATIONS)} "
            "or add yours to `spectrax_core.nn.ACTIVATIONS`."
        )
    return name


class MLP(Composite):
    """Parameters of `down(activation(up(x)))`, `d_model → d_ff → d_model`.

    `activation` is a name from `ACTIVATIONS` (a string keeps the params
    hashable and comparable across instances); the default "gelu" is the tanh
    approximation (`jax.nn.gelu`).
    """

    up: Linear
    down: Linear
    d_model: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    activation: str = eqx.field(static=True, default="gelu")

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "gelu",
        use_bias: bool = True,
        **options: Unpack[ParamOptions],
    ) -> "MLP":
        """Lecun-normal weights, zero biases (or `w_init` / `b_init` for every projection);
        `compute_dtype` goes to each projection."""
        k_up, k_down = jax.random.split(key)
        kw = dict(use_bias=use_bias, **options)
        return cls(
            up=Linear.init(k_up, d_model, d_ff, **kw, axes=("EMBED", "MLP")),
            down=Linear.init(k_down, d_ff, d_model, **kw, axes=("MLP", "EMBED")),
            d_model=d_model,
            d_ff=d_ff,
            activation=_check_activation(activation),
        )


class GatedMLP(Composite):
    """Parameters of `down(activation(gate(x)) * up(x))` (SwiGLU with the default "silu")."""

    gate: Linear
    up: Linear
    down: Linear
    d_model: int = eqx.field(static=True)
    d_ff: int = eqx.field(static=True)
    activation: str = eqx.field(static=True, default="silu")

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "silu",
        use_bias: bool = False,
        **options: Unpack[ParamOptions],
    ) -> "GatedMLP":
        """Lecun-normal weights (or `w_init` / `b_init`); no biases by default, as in LLaMA-style
        blocks; `compute_dtype` goes to each projection."""
        k_gate, k_up, k_down = jax.random.split(key, 3)
        kw = dict(use_bias=use_bias, **options)
        return cls(
            gate=Linear.init(k_gate, d_model, d_ff, **kw, axes=("EMBED", "MLP")),
            up=Linear.init(k_up, d_model, d_ff, **kw, axes=("EMBED", "MLP")),
            down=Linear.init(k_down, d_ff, d_model, **kw, axes=("MLP", "EMBED")),
            d_model=d_model,
            d_ff=d_ff,
            activation=_check_activation(activation),
        )


@typechecked
def _mlp(params: MLP, x: Float[Array, "*batch d_model"]) -> Float[Array, "*batch d_model"]:
    return _linear(params.down, ACTIVATIONS[params.activation](_linear(params.up, x)))


@typechecked
def _gated_mlp(params: GatedMLP, x: Float[Array, "*batch d_model"]) -> Float[Array, "*batch d_model"]:
    gate = ACTIVATIONS[params.activation](_linear(params.gate, x))
    return _linear(params.down, gate * _linear(params.up, x))


@register_apply(MLP)
def apply_mlp(params: MLP, x: Array) -> Array:
    """Apply the MLP to `x` of shape `(..., d_model)`."""
    check_last_dim("MLP", x, params.d_model)
    return _mlp(params, x)


@register_apply(GatedMLP)
def apply_gated_mlp(params: GatedMLP, x: Array) -> Array:
    """Apply the gated MLP to `x` of shape `(..., d_model)`."""
    check_last_dim("GatedMLP", x, params.d_model)
    return _gated_mlp(params, x)
