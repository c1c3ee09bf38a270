"""`spectrax_eager.core.variable`: `spectrax-lib`'s module path `spectrax.core.variable`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_built
from .._graph.deferred import DeferredBuffer, DeferredParameter
from .._graph.variable import Buffer, Parameter, Variable
from .._scope.init_placement import InitPlacementHook, variable_init_placement

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = [
    "Buffer",
    "DeferredBuffer",
    "DeferredParameter",
    "InitPlacementHook",
    "Parameter",
    "Variable",
    "variable_init_placement",
]
