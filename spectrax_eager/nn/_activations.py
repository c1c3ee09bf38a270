"""Activation modules and `Identity`: parameter-free layers for `Sequential` and friends.

Each calls the `spectrax_core.functional` function of the same name.
"""

from __future__ import annotations

from typing import Any

import jax

import spectrax_core as sc

from .._graph.module import Module


class Identity(Module):
    """Returns its input unchanged (extra arguments are accepted and ignored)."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class ReLU(Module):
    """`max(x, 0)`."""

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.relu(x)


class GELU(Module):
    """`x · Φ(x)`; `approximate="none"` (default, exact, as PyTorch) or `"tanh"` (the tanh form);
    `False` / `True` mean the same two."""

    def __init__(self, approximate: str | bool = "none"):
        if isinstance(approximate, bool):
            approximate = "tanh" if approximate else "none"
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', received {approximate!r}.")
        self.approximate = approximate

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.gelu(x, approximate=self.approximate == "tanh")


class SiLU(Module):
    """`x · sigmoid(x)` (swish)."""

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.silu(x)


class Tanh(Module):
    """`tanh(x)`."""

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.tanh(x)


class Sigmoid(Module):
    """`1 / (1 + exp(-x))`."""

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.functional.sigmoid(x)
