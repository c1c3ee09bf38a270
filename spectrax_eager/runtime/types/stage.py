"""`spectrax_eager.runtime.types.stage`: `spectrax-lib`'s module path `spectrax.runtime.types.stage`;
none of its names is built here, and importing one says what to use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "stage types")
__all__ = ()
