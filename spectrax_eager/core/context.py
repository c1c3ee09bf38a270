"""`spectrax_eager.core.context`: `spectrax-lib`'s module path `spectrax.core.context`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._scope.frames import scope

__getattr__ = not_kept(__name__, "core")

__all__ = ["scope"]
