"""`spectrax_eager.functional.conv`: `spectrax-lib`'s module path `spectrax.functional.conv`, holding
functional ops (`spx.functional`'s)."""

from . import conv, conv_transpose

__all__ = ["conv", "conv_transpose"]
