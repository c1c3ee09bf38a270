"""`spectrax_eager.nn.activation`: `spectrax-lib`'s module path `spectrax.nn.activation`, holding
layers (`spx.nn`'s)."""

from ._activations import GELU, ReLU, Sigmoid, SiLU, Tanh

__all__ = ["GELU", "ReLU", "SiLU", "Sigmoid", "Tanh"]
