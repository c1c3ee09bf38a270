"""`spectrax_eager.functional.norm`: `spectrax-lib`'s module path `spectrax.functional.norm`, holding
functional ops (`spx.functional`'s)."""

from . import layer_norm, rms_norm

__all__ = ["layer_norm", "rms_norm"]
