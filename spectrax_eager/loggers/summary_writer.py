"""`spectrax_eager.loggers.summary_writer`: `spectrax-lib`'s module path
`spectrax.loggers.summary_writer`; none of its names is built here, and importing one says what to
use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "logging")
__all__ = ()
