"""`spectrax_eager.loggers.console`: `spectrax-lib`'s module path `spectrax.loggers.console`; none of
its names is built here, and importing one says what to use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "logging")
__all__ = ()
