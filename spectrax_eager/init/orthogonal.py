"""`spectrax_eager.init.orthogonal`: `spectrax-lib`'s module path `spectrax.init.orthogonal`, holding
initializers (`spx.init`'s)."""

from . import orthogonal

__all__ = ["orthogonal"]
