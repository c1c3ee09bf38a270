"""`spectrax_eager.runtime.primitives.split`: `spectrax-lib`'s module path
`spectrax.runtime.primitives.split`; none of its names is built here, and importing one says what to
use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "stage markers")
__all__ = ()
