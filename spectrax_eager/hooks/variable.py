"""`spectrax_eager.hooks.variable`: `spectrax-lib`'s module path `spectrax.hooks.variable`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "variable hooks")
__all__ = ()
