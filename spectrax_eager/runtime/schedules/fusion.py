"""`spectrax_eager.runtime.schedules.fusion`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.fusion`; none of its names is built here, and importing one says what to
use."""

from ..._compat.paths import not_kept

__getattr__ = not_kept(__name__, "fusion")
__all__ = ()
