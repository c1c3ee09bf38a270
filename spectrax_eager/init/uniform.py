"""`spectrax_eager.init.uniform`: `spectrax-lib`'s module path `spectrax.init.uniform`, holding
initializers (`spx.init`'s)."""

from . import uniform

__all__ = ["uniform"]
