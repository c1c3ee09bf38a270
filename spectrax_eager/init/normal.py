"""`spectrax_eager.init.normal`: `spectrax-lib`'s module path `spectrax.init.normal`, holding
initializers (`spx.init`'s)."""

from . import normal, truncated_normal

__all__ = ["normal", "truncated_normal"]
