"""`spectrax_eager.inspect.tree`: `spectrax-lib`'s module path `spectrax.inspect.tree`, holding
inspection helpers (`spx.inspect`'s)."""

from .._compat.paths import not_built
from .._graph.export import tree_state

__getattr__ = not_built(
    __name__, "spx.inspect.tree_state(model) gives the model's State, whose paths() and values are these"
)

__all__ = ["tree_state"]
