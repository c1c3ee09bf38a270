"""`spectrax_eager.core.paths`: `spectrax-lib`'s module path `spectrax.core.paths`, holding the module
system's names (`spx`'s)."""

from .._compat.paths import not_kept
from ..typing import Path, PathComponent

__getattr__ = not_kept(__name__, "core")

__all__ = ["Path", "PathComponent"]
