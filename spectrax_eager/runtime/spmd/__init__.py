"""`spectrax_eager.runtime.spmd`: `spectrax-lib`'s module path `spectrax.runtime.spmd`; none of its
names is built here, and importing one says what to use."""

from ..._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "pipelines here run one program per rank (MPMD): spx.run on a mesh with a pipeline axis, or sxjit",
)

__all__ = ()
