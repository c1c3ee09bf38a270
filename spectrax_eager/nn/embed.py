"""`spectrax_eager.nn.embed`: `spectrax-lib`'s module path `spectrax.nn.embed`, holding layers
(`spx.nn`'s)."""

from ._layers import Embed

__all__ = ["Embed"]
