"""`spectrax_eager.core.graph`: `spectrax-lib`'s module path `spectrax.core.graph`, holding the module
system's names (`spx`'s)."""

from .._compat.paths import not_kept
from .._graph.export import bind, clone, export, tree_state, update
from .._graph.structure import GraphDef
from .._graph.walk import find, iter_variables, live_variables

__getattr__ = not_kept(__name__, "core")

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
