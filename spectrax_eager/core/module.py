"""`spectrax_eager.core.module`: `spectrax-lib`'s module path `spectrax.core.module`, holding the
module system's names (`spx`'s)."""

from .._compat.markers import Opaque
from .._graph.module import Module

__all__ = ["Module", "Opaque"]
