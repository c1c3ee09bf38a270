"""`spectrax_eager.runtime.spmd.api`: `spectrax-lib`'s module path `spectrax.runtime.spmd.api`; none of
its names is built here, and importing one says what to use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "spmd pipelines")
__all__ = ()
