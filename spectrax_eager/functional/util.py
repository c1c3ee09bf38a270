"""`spectrax_eager.functional.util`: `spectrax-lib`'s module path `spectrax.functional.util`, holding
functional ops (`spx.functional`'s)."""

from . import promote_dtype

__all__ = ["promote_dtype"]
