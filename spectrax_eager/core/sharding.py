"""`spectrax_eager.core.sharding`: `spectrax-lib`'s module path `spectrax.core.sharding`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._sharding.rules import Sharding
from ..typing import AxisNames

__getattr__ = not_kept(__name__, "core")

__all__ = ["AxisNames", "Sharding"]
