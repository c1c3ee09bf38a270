"""`spectrax_eager.core.graph`: `spectrax-lib`'s module path `spectrax.core.graph`, holding the module
system's names (`spx`'s)."""

from .._compat.paths import not_built
from .._graph.export import bind, clone, export, tree_state, update
from .._graph.structure import GraphDef
from .._graph.walk import find, iter_variables, live_variables

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = [
    "GraphDef",
    "bind",
    "clone",
    "export",
    "find",
    "iter_variables",
    "live_variables",
    "tree_state",
    "update",
]
