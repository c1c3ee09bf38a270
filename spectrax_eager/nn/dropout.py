"""`spectrax_eager.nn.dropout`: `spectrax-lib`'s module path `spectrax.nn.dropout`, holding layers
(`spx.nn`'s)."""

from ._layers import Dropout

__all__ = ["Dropout"]
