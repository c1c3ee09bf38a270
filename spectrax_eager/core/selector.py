"""`spectrax_eager.core.selector`: `spectrax-lib`'s module path `spectrax.core.selector`, holding the
module system's names (`spx`'s)."""

from .._compat.paths import not_built
from .._graph.selector import (
    Everything,
    Nothing,
    Selector,
    all_of,
    any_of,
    as_selector,
    not_,
    of_type,
    path_contains,
    path_endswith,
    path_startswith,
    select,
)

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = [
    "Everything",
    "Nothing",
    "Selector",
    "all_of",
    "any_of",
    "as_selector",
    "not_",
    "of_type",
    "path_contains",
    "path_endswith",
    "path_startswith",
    "select",
]
