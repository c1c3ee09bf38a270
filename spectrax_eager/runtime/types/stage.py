"""`spectrax_eager.runtime.types.stage`: `spectrax-lib`'s module path `spectrax.runtime.types.stage`;
none of its names is built here, and importing one says what to use."""

from ..._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "stages are cut by spx.run (a `blocks` ModuleList, a PipelineSequential, assign_stage), and"
    " a mesh from spx.create_mesh(..., mpmd_axis=...) is its own MPMD view",
)

__all__ = ()
