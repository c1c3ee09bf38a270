"""`spectrax_eager.runtime.mpmd.treduce`: `spectrax-lib`'s module path `spectrax.runtime.mpmd.treduce`;
none of its names is built here, and importing one says what to use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "mpmd internals")
__all__ = ()
