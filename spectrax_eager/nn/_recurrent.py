"""Eager recurrent cells and `RNN`, which runs a cell over a sequence with `lax.scan`
(math in `spectrax_core.nn._recurrent`, gate formulas as PyTorch's)."""

from __future__ import annotations

from typing import Any

import jax

import spectrax_core as sc

from .._module import Module
from .._rngs import Rngs
from ._base import PARAM_DTYPE, CoreLayer, also_named, dtype_kwargs, key_from


@also_named(in_features=("input_size", "d_in"), hidden_features=("hidden_size", "hidden"))
class _CellLayer(CoreLayer):
    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        **extra: Any,
    ):
        where = type(self).__name__
        kw = dtype_kwargs(dtype, param_dtype, w_init, b_init)
        self._adopt(
            self.core_cls.init(
                key_from(rngs, where), input_size, hidden_size, use_bias=use_bias, **kw, **extra
            )
        )

    def forward(self, carry: Any, x: jax.Array) -> tuple[Any, jax.Array]:
        """One step: `(carry, x) -> (new_carry, y)`."""
        return sc.apply(self.core_params(), carry, x)

    def initialize_carry(self, batch_shape: tuple[int, ...] = (), dtype: Any = None) -> Any:
        """A zero carry for inputs of leading shape `batch_shape`."""
        return self.core_params().initialize_carry(tuple(batch_shape), dtype)


class SimpleRNNCell(_CellLayer):
    """`h' = tanh(ih(x) + hh(h))` (`activation="relu"` for relu); carry `h`."""

    core_cls = sc.nn.SimpleRNNCell

    def __init__(self, input_size: int, hidden_size: int, *, activation: str = "tanh", **kwargs: Any):
        super().__init__(input_size, hidden_size, activation=activation, **kwargs)


class LSTMCell(_CellLayer):
    """LSTM cell (gates i, f, g, o as PyTorch); carry `(h, c)`."""

    core_cls = sc.nn.LSTMCell


class GRUCell(_CellLayer):
    """GRU cell (gates r, z, n as PyTorch); carry `h`."""

    core_cls = sc.nn.GRUCell


class RNN(Module):
    """Runs `cell` over the time axis of `(batch, time, features)` (or `(time, batch, features)`
    with `time_major=True`) under `lax.scan`.

    `rnn(xs, initial_carry=None)` returns the outputs `ys`, or `(final_carry, ys)`
    with `return_carry=True`; `reverse=True` runs from the last step.
    """

    def __init__(
        self,
        cell: _CellLayer,
        *,
        time_major: bool = False,
        reverse: bool = False,
        return_carry: bool = False,
    ):
        if not isinstance(cell, _CellLayer):
            raise TypeError(
                f"RNN: cell must be an spx.nn.SimpleRNNCell, LSTMCell or GRUCell, received {type(cell).__name__}."
            )
        self.cell = cell
        self.time_major = bool(time_major)
        self.reverse = bool(reverse)
        self.return_carry = bool(return_carry)

    def forward(self, xs: jax.Array, initial_carry: Any = None) -> Any:
        carry, ys = sc.nn.rnn(
            self.cell.core_params(), xs, initial_carry, time_major=self.time_major, reverse=self.reverse
        )
        return (carry, ys) if self.return_carry else ys
