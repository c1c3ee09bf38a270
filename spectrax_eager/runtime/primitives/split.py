"""`spectrax_eager.runtime.primitives.split`: `spectrax-lib`'s module path
`spectrax.runtime.primitives.split`; none of its names is built here, and importing one says what to
use."""

from ..._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "stage boundaries are marked with spx.sxstage_iter, and spx.run cuts a `blocks` ModuleList,"
    " a PipelineSequential or assign_stage blocks into stages",
)

__all__ = ()
