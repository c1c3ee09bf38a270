"""`spectrax_eager.nn.dense`: `spectrax-lib`'s module path `spectrax.nn.dense`, holding layers
(`spx.nn`'s)."""

from ._general import DenseGeneral, Einsum

__all__ = ["DenseGeneral", "Einsum"]
