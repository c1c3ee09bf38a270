"""`spectrax_eager.core.state`: `spectrax-lib`'s module path `spectrax.core.state`, holding the module
system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._graph.state import State

__getattr__ = not_kept(__name__, "core")

__all__ = ["State"]
