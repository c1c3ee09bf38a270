"""`spectrax_eager.init.kaiming`: `spectrax-lib`'s module path `spectrax.init.kaiming`, holding
initializers (`spx.init`'s)."""

from . import kaiming_normal, kaiming_uniform

__all__ = ["kaiming_normal", "kaiming_uniform"]
