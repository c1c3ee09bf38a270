"""`spectrax_eager.init.xavier`: `spectrax-lib`'s module path `spectrax.init.xavier`, holding
initializers (`spx.init`'s)."""

from . import xavier_normal, xavier_uniform

__all__ = ["xavier_normal", "xavier_uniform"]
