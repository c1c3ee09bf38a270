"""`spectrax_eager.runtime.schedules.gpipe`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.gpipe`, holding the pipeline schedules (`spx`'s)."""

from ..._compat.schedules import GPipe

__all__ = ["GPipe"]
