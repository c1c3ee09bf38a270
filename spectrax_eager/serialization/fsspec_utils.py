"""`spectrax_eager.serialization.fsspec_utils`: `spectrax-lib`'s module path
`spectrax.serialization.fsspec_utils`; none of its names is built here, and importing one says what
to use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "checkpoints")
__all__ = ()
