"""`spectrax_eager.runtime.mpmd.per_rank`: `spectrax-lib`'s module path
`spectrax.runtime.mpmd.per_rank`; none of its names is built here, and importing one says what to
use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "mpmd internals")
__all__ = ()
