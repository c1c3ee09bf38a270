"""`spectrax_eager.functional.dropout`: `spectrax-lib`'s module path `spectrax.functional.dropout`,
holding functional ops (`spx.functional`'s)."""

from . import dropout

__all__ = ["dropout"]
