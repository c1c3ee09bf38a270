"""`spectrax_eager.transforms.split_merge`: `spectrax-lib`'s module path
`spectrax.transforms.split_merge`; none of its names is built here, and importing one says what to
use."""

from .._compat.paths import not_kept

__getattr__ = not_kept(__name__, "transform internals")
__all__ = ()
