"""`spectrax_eager.nn.mlp`: `spectrax-lib`'s module path `spectrax.nn.mlp`, holding layers
(`spx.nn`'s)."""

from ._attention import MLPBlock

__all__ = ["MLPBlock"]
