"""`spectrax_eager.core.stage_assignment`: `spectrax-lib`'s module path
`spectrax.core.stage_assignment`, holding the module system's names (`spx`'s)."""

from .._compat.paths import not_built
from .._pipeline.stages import assign_stage

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = ["assign_stage"]
