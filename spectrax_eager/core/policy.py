"""`spectrax_eager.core.policy`: `spectrax-lib`'s module path `spectrax.core.policy`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._scope.policy import Policy

__getattr__ = not_kept(__name__, "core")

__all__ = ["Policy"]
