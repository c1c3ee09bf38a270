"""`spectrax_eager.transforms.split_merge`: `spectrax-lib`'s module path
`spectrax.transforms.split_merge`; none of its names is built here, and importing one says what to
use."""

from .._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "spectrax-lib's transform internals are not kept; spx.jit, spx.grad, spx.vmap, spx.scan, "
    "... take modules as arguments directly",
)

__all__ = ()
