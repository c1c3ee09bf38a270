"""`spectrax_eager.serialization.async_manager`: `spectrax-lib`'s module path
`spectrax.serialization.async_manager`; none of its names is built here, and importing one says what
to use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "checkpoints")
__all__ = ()
