"""`spectrax_eager.core`: `spectrax-lib`'s module path `spectrax.core`, holding the module system's
names (`spx`'s)."""

from .._compat.paths import not_built
from .errors import (
    CyclicGraphError,
    IllegalMutationError,
    LazyInitUnderTransformError,
    SelectorError,
    SpecTraxError,
)
from .lazy_init import lazy_init
from .paths import Path
from .policy import Policy
from .sharding import AxisNames, Sharding
from .stage_assignment import assign_stage
from .state import State
from .static import Static
from .variable import Buffer, InitPlacementHook, Parameter, Variable, variable_init_placement

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = [
    "AxisNames",
    "Buffer",
    "CyclicGraphError",
    "IllegalMutationError",
    "InitPlacementHook",
    "LazyInitUnderTransformError",
    "Parameter",
    "Path",
    "Policy",
    "SelectorError",
    "Sharding",
    "SpecTraxError",
    "State",
    "Static",
    "Variable",
    "assign_stage",
    "lazy_init",
    "variable_init_placement",
]
