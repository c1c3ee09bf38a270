"""`spectrax_eager.core.static`: `spectrax-lib`'s module path `spectrax.core.static`, holding the
module system's names (`spx`'s)."""

from .._compat.markers import Static
from .._compat.paths import not_built

__getattr__ = not_built(
    __name__, "spectrax-lib's typing variable and scalar check are not kept; spx.Static marks a value static"
)

__all__ = ["Static"]
