"""`spectrax_eager.core.stage_assignment`: `spectrax-lib`'s module path
`spectrax.core.stage_assignment`, holding the module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._pipeline.stages import assign_stage

__getattr__ = not_kept(__name__, "core")

__all__ = ["assign_stage"]
