"""`spectrax_eager.core.variable`: `spectrax-lib`'s module path `spectrax.core.variable`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._graph.deferred import DeferredBuffer, DeferredParameter
from .._graph.variable import Buffer, Parameter, Variable
from .._scope.init_placement import InitPlacementHook, variable_init_placement

__getattr__ = not_kept(__name__, "core")

__all__ = [
    "Buffer",
    "DeferredBuffer",
    "DeferredParameter",
    "InitPlacementHook",
    "Parameter",
    "Variable",
    "variable_init_placement",
]
