"""`spectrax_eager.core.registry`: `spectrax-lib`'s module path `spectrax.core.registry`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "core")
__all__ = ()
