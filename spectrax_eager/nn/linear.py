"""`spectrax_eager.nn.linear`: `spectrax-lib`'s module path `spectrax.nn.linear`, holding layers
(`spx.nn`'s)."""

from ._general import Bilinear
from ._layers import Linear

__all__ = ["Bilinear", "Linear"]
