"""`spectrax_eager.core`: `spectrax-lib`'s module path `spectrax.core`, holding the module system's
names (`spx`'s)."""

from .._compat.paths import not_kept
from .errors import *  # the error types, as `spectrax.core.errors` holds them
from .lazy_init import lazy_init
from .paths import Path
from .policy import Policy
from .sharding import AxisNames, Sharding
from .stage_assignment import assign_stage
from .state import State
from .static import Static
from .variable import Buffer, InitPlacementHook, Parameter, Variable, variable_init_placement

__getattr__ = not_kept(__name__, "core")

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
