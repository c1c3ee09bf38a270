"""`spectrax_eager.loggers.base`: `spectrax-lib`'s module path `spectrax.loggers.base`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "metric logging is not part of this project; log the values a training step returns with a "
    "logger of your own",
)

__all__ = ()
