"""`spectrax_eager.core.errors`: `spectrax-lib`'s module path `spectrax.core.errors`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._errors import (
    CyclicGraphError,
    IllegalMutationError,
    LazyInitUnderTransformError,
    SelectorError,
    SpecTraxError,
)

__getattr__ = not_kept(__name__, "core")

__all__ = [
    "CyclicGraphError",
    "IllegalMutationError",
    "LazyInitUnderTransformError",
    "SelectorError",
    "SpecTraxError",
]
