"""`spectrax_eager.core.selector`: `spectrax-lib`'s module path `spectrax.core.selector`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._graph.selector import *
from .._graph.selector import __all__  # noqa: F401 (the names this path re-exports)

__getattr__ = not_kept(__name__, "core")
