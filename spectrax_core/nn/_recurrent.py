"""Recurrent cells (SimpleRNNCell, LSTMCell, GRUCell) and `rnn`, which runs a cell over a
sequence with `lax.scan`.

Each cell has an input projection `ih: d_in → k·hidden` and a recurrent one
`hh: hidden → k·hidden`, both with biases by default; `apply(cell, carry, x)`
returns `(new_carry, y)`. The gate formulas are PyTorch's:

* SimpleRNNCell: `h' = tanh(ih(x) + hh(h))` (or relu).
* LSTMCell: gates `i, f, g, o` in that order along the projection;
  `c' = σ(f)·c + σ(i)·tanh(g)`, `h' = σ(o)·tanh(c')`; the carry is `(h, c)`.
* GRUCell: gates `r, z, n`; `r = σ(ih_r + hh_r)`, `z = σ(ih_z + hh_z)`,
  `n = tanh(ih_n + r·hh_n)`, `h' = (1 - z)·n + z·h`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Unpack

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PRNGKeyArray

from .._apply import apply, register_apply
from .._checks import check_last_dim
from ._linear import Linear, _linear
from ._options import ParamOptions, with_options

_CELL_ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu}


def _projections(key, d_in, hidden, k, use_bias, options):
    k_ih, k_hh = jax.random.split(key)
    kw = dict(use_bias=use_bias, **options)
    return (
        Linear.init(k_ih, d_in, k * hidden, **kw, axes=(None, None)),
        Linear.init(k_hh, hidden, k * hidden, **kw, axes=(None, None)),
    )


class _Cell(eqx.Module):
    """Shared fields and `init` of the cells; `gates` is the number of hidden-sized projections."""

    ih: Linear
    hh: Linear
    d_in: int = eqx.field(static=True)
    hidden: int = eqx.field(static=True)

    def logical_axes(self) -> dict[str, tuple]:
        """No array fields of its own; `ih` and `hh` declare theirs."""
        return {}

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_in: int,
        hidden: int,
        *,
        use_bias: bool = True,
        **options: Unpack[ParamOptions],
    ):
        """Lecun-normal projections and zero biases (or `w_init` / `b_init`)."""
        ih, hh = _projections(key, d_in, hidden, cls.gates, use_bias, options)
        return cls(ih=ih, hh=hh, d_in=d_in, hidden=hidden)

    def initialize_carry(self, batch_shape: tuple[int, ...] = (), dtype=None) -> Any:
        """A zero carry for inputs of leading shape `batch_shape`."""
        dtype = self.hh.weight.dtype if dtype is None else dtype
        return jnp.zeros((*batch_shape, self.hidden), dtype)


class SimpleRNNCell(_Cell):
    """Parameters of `h' = activation(ih(x) + hh(h))`, `activation` "tanh" (default) or "relu"."""

    activation: str = eqx.field(static=True, default="tanh")
    gates = 1

    @classmethod
    def init(cls, key: PRNGKeyArray, d_in: int, hidden: int, *, activation: str = "tanh", **kwargs: Any):
        """As `_Cell.init` (`use_bias`, `dtype`, `w_init`, `b_init`, `compute_dtype`), plus the activation."""
        if activation not in _CELL_ACTIVATIONS:
            raise ValueError(
                f"SimpleRNNCell: activation must be one of {sorted(_CELL_ACTIVATIONS)}, received {activation!r}."
            )
        return dataclasses.replace(super().init(key, d_in, hidden, **kwargs), activation=activation)


class LSTMCell(_Cell):
    """Parameters of an LSTM cell (gates i, f, g, o); the carry is `(h, c)`."""

    gates = 4

    def initialize_carry(self, batch_shape: tuple[int, ...] = (), dtype=None) -> tuple[Array, Array]:
        """Zero `(h, c)` for inputs of leading shape `batch_shape`."""
        h = super().initialize_carry(batch_shape, dtype)
        return h, jnp.zeros_like(h)


class GRUCell(_Cell):
    """Parameters of a GRU cell (gates r, z, n)."""

    gates = 3


def _check(cell: _Cell, x: Array) -> None:
    check_last_dim(type(cell).__name__, x, cell.d_in)


@register_apply(SimpleRNNCell)
def apply_simple_rnn_cell(cell: SimpleRNNCell, carry: Array, x: Array) -> tuple[Array, Array]:
    """One step: `(h, x) -> (h', h')`."""
    _check(cell, x)
    h = _CELL_ACTIVATIONS[cell.activation](_linear(cell.ih, x) + _linear(cell.hh, carry))
    return h, h


@register_apply(LSTMCell)
def apply_lstm_cell(
    cell: LSTMCell, carry: tuple[Array, Array], x: Array
) -> tuple[tuple[Array, Array], Array]:
    """One step: `((h, c), x) -> ((h', c'), h')`."""
    _check(cell, x)
    h, c = carry
    i, f, g, o = jnp.split(_linear(cell.ih, x) + _linear(cell.hh, h), 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (h, c), h


@register_apply(GRUCell)
def apply_gru_cell(cell: GRUCell, carry: Array, x: Array) -> tuple[Array, Array]:
    """One step: `(h, x) -> (h', h')`."""
    _check(cell, x)
    xr, xz, xn = jnp.split(_linear(cell.ih, x), 3, axis=-1)
    hr, hz, hn = jnp.split(_linear(cell.hh, carry), 3, axis=-1)
    r = jax.nn.sigmoid(xr + hr)
    z = jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    h = (1.0 - z) * n + z * carry
    return h, h


def rnn(
    cell: _Cell,
    xs: Array,
    carry: Any = None,
    *,
    time_major: bool = False,
    reverse: bool = False,
) -> tuple[Any, Array]:
    """Run `cell` over the time axis of `xs` with `lax.scan`; returns `(final_carry, ys)`.

    `xs` is `(batch, time, d_in)` (or `(time, batch, d_in)` with
    `time_major=True`); `ys` has the same layout with `hidden` features.
    `carry` defaults to zeros; `reverse=True` runs from the last step to the
    first (outputs stay aligned with their inputs).
    """
    if not isinstance(cell, _Cell):
        raise TypeError(
            f"rnn: cell must be a SimpleRNNCell, LSTMCell or GRUCell, received {type(cell).__name__}."
        )
    if xs.ndim < 2:
        raise ValueError(f"rnn: xs must have a time axis and features, received shape {tuple(xs.shape)}.")
    check_last_dim("rnn", xs, cell.d_in)
    seq = xs if time_major else jnp.moveaxis(xs, -2 if xs.ndim == 2 else 1, 0)
    if carry is None:
        carry = cell.initialize_carry(seq.shape[1:-1], seq.dtype)
    carry, ys = lax.scan(lambda c, x: apply(cell, c, x), carry, seq, reverse=reverse)
    return carry, (ys if time_major else jnp.moveaxis(ys, 0, -2 if xs.ndim == 2 else 1))
