"""`spectrax_eager.core.state`: `spectrax-lib`'s module path `spectrax.core.state`, holding the module
system's names (`spx`'s)."""

from .._compat.paths import not_built
from .._graph.state import State

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = ["State"]
