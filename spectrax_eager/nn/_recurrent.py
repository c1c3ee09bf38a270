"""Eager recurrent cells and `RNN`, which runs a cell over a sequence with `lax.scan`
(math in `spectrax_core.nn._recurrent`, gate formulas as PyTorch's)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import spectrax_core as sc

from .._graph.module import Module
from .._graph.variable import Parameter
from .._graph.rngs import Rngs
from ._base import PARAM_DTYPE, CoreLayer, also_named, key_from, split_options


@also_named(in_features=("input_size", "d_in"), hidden_features=("hidden_size", "hidden"))
class RNNCellBase(CoreLayer):
    """Base of the recurrent cells: `cell(carry, x) -> (new_carry, y)`, `initialize_carry(batch_shape)`."""

    def __init__(
        self,
        input_size: int | None = None,
        hidden_size: int | None = None,
        *,
        use_bias: bool = True,
        **extra: Any,
    ):
        options, extra = split_options(extra)
        if input_size is None and hidden_size is None and not extra:
            return  # a cell written by subclassing: its own __init__ makes its variables
        if input_size is None or hidden_size is None:
            raise TypeError(
                f"{type(self).__name__}: give both input_size and hidden_size, "
                f"got {input_size}, {hidden_size}."
            )
        self._build(input_size, hidden_size, use_bias=use_bias, options=options, **extra)

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
                "RNN: cell must be an spx.nn.SimpleRNNCell, LSTMCell or GRUCell, "
                f"received {type(cell).__name__}."
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


class ConvLSTMCell(Module):
    """2-d convolutional LSTM cell: the gates (input, forget, cell, output) are one convolution of
    `[x, h]` (channels last), so `(h, c)` keep the spatial shape `(N, H, W, out_channels)`.

    `cell(carry, x) -> ((h, c), h)`; `initial_carry((N, H, W))` gives zeros. The kernel is
    `(*kernel_size, in_channels + out_channels, 4 * out_channels)` (Lecun-normal), the bias zero.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int] = 3,
        *,
        padding: str = "SAME",
        use_bias: bool = True,
        rngs: Rngs | None = None,
        w_init: Any = None,
        b_init: Any = None,
        dtype: Any = None,
    ):
        kernel = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        dtype = PARAM_DTYPE if dtype is None else dtype
        w_key, b_key = jax.random.split(key_from(rngs, "ConvLSTMCell"))
        shape = (*kernel, in_channels + out_channels, 4 * out_channels)
        w_init = sc.init.lecun_normal() if w_init is None else w_init
        self.weight = Parameter(sc.init.initialize(w_init, w_key, shape, dtype, where="ConvLSTMCell: w_init"))
        self.bias = None
        if use_bias:
            b_init = sc.init.zeros if b_init is None else b_init
            b = sc.init.initialize(b_init, b_key, (4 * out_channels,), dtype, where="ConvLSTMCell: b_init")
            self.bias = Parameter(b)
        self.in_channels, self.out_channels, self.padding = in_channels, out_channels, padding

    def forward(
        self, carry: tuple[jax.Array, jax.Array], x: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        h, c = carry
        bias = None if self.bias is None else self.bias.value
        z = sc.functional.conv(jnp.concatenate([x, h], -1), self.weight.value, bias, padding=self.padding)
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    def initial_carry(
        self, batch_shape: tuple[int, int, int], *, dtype: Any = None
    ) -> tuple[jax.Array, jax.Array]:
        """Zero `(h, c)` of shape `(*batch_shape, out_channels)` (`batch_shape` is `(N, H, W)`)."""
        zeros = jnp.zeros((*batch_shape, self.out_channels), self.weight.dtype if dtype is None else dtype)
        return zeros, zeros

    initialize_carry = initial_carry


__all__ = [
    "Bidirectional",
    "ConvLSTMCell",
    "GRUCell",
    "LSTMCell",
    "OptimizedLSTMCell",
    "RNN",
    "RNNCellBase",
    "SimpleRNNCell",
]
