"""`spectrax_eager.init.constant`: `spectrax-lib`'s module path `spectrax.init.constant`, holding
initializers (`spx.init`'s)."""

from . import constant, ones, zeros

__all__ = ["constant", "ones", "zeros"]
