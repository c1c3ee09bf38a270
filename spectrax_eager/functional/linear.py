"""`spectrax_eager.functional.linear`: `spectrax-lib`'s module path `spectrax.functional.linear`,
holding functional ops (`spx.functional`'s)."""

from . import linear

__all__ = ["linear"]
