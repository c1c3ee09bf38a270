"""`spectrax_eager.nn.recurrent`: `spectrax-lib`'s module path `spectrax.nn.recurrent`, holding layers
(`spx.nn`'s)."""

from ._recurrent import (
    RNN,
    Bidirectional,
    ConvLSTMCell,
    GRUCell,
    LSTMCell,
    OptimizedLSTMCell,
    RNNCellBase,
    SimpleRNNCell,
)

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
