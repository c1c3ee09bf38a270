"""Eager recurrent cells and `RNN`, which runs a cell over a sequence with `lax.scan`
(math in `spectrax_core.nn._recurrent`, gate formulas as PyTorch's)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import spectrax_core as sc

from .._module import Module
from .._rngs import Rngs
from ._base import PARAM_DTYPE, CoreLayer, also_named, dtype_kwargs, key_from


@also_named(in_features=("input_size", "d_in"), hidden_features=("hidden_size", "hidden"))
class RNNCellBase(CoreLayer):
    """Base of the recurrent cells: `cell(carry, x) -> (new_carry, y)`, `initialize_carry(batch_shape)`."""

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


class SimpleRNNCell(RNNCellBase):
    """`h' = tanh(ih(x) + hh(h))` (`activation="relu"` for relu); carry `h`."""

    core_cls = sc.nn.SimpleRNNCell

    def __init__(self, input_size: int, hidden_size: int, *, activation: str = "tanh", **kwargs: Any):
        super().__init__(input_size, hidden_size, activation=activation, **kwargs)


class LSTMCell(RNNCellBase):
    """LSTM cell (gates i, f, g, o as PyTorch); carry `(h, c)`."""

    core_cls = sc.nn.LSTMCell


class OptimizedLSTMCell(LSTMCell):
    """`LSTMCell` (its gate projections already run as one matrix product per input)."""


class GRUCell(RNNCellBase):
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
        cell: RNNCellBase,
        *,
        time_major: bool = False,
        reverse: bool = False,
        return_carry: bool = False,
    ):
        if not isinstance(cell, RNNCellBase):
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


class Bidirectional(Module):
    """Runs `forward_rnn` over the sequence and `backward_rnn` over it reversed (its outputs kept
    in time order), then merges the two outputs: `merge_mode` "concat" (on the feature axis),
    "sum", "mul" or "ave"."""

    MERGES = ("concat", "sum", "mul", "ave")

    def __init__(self, forward_rnn: RNN, backward_rnn: RNN, *, merge_mode: str = "concat"):
        if merge_mode not in self.MERGES:
            raise ValueError(f"Bidirectional: merge_mode={merge_mode!r}; use one of {self.MERGES}.")
        for name, rnn in (("forward_rnn", forward_rnn), ("backward_rnn", backward_rnn)):
            if not isinstance(rnn, RNN):
                raise TypeError(
                    f"Bidirectional: {name} must be an spx.nn.RNN, received {type(rnn).__name__}."
                )
        self.forward_rnn, self.backward_rnn, self.merge_mode = forward_rnn, backward_rnn, merge_mode

    def forward(self, xs: jax.Array, initial_carry: tuple[Any, Any] | None = None) -> jax.Array:
        first, second = (None, None) if initial_carry is None else initial_carry
        f, b = self.forward_rnn, self.backward_rnn
        _, ys_f = sc.nn.rnn(f.cell.core_params(), xs, first, time_major=f.time_major, reverse=False)
        _, ys_b = sc.nn.rnn(b.cell.core_params(), xs, second, time_major=b.time_major, reverse=True)
        if self.merge_mode == "concat":
            return jnp.concatenate([ys_f, ys_b], axis=-1)
        if self.merge_mode == "sum":
            return ys_f + ys_b
        if self.merge_mode == "mul":
            return ys_f * ys_b
        return 0.5 * (ys_f + ys_b)
