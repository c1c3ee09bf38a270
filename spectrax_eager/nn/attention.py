"""`spectrax_eager.nn.attention`: `spectrax-lib`'s module path `spectrax.nn.attention`, holding layers
(`spx.nn`'s)."""

from ._attention import CausalSelfAttention, MultiheadAttention

__all__ = ["CausalSelfAttention", "MultiheadAttention"]
