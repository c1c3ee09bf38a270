"""`spectrax_eager.core.registry`: `spectrax-lib`'s module path `spectrax.core.registry`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "spectrax-lib's core internals are not kept; a model's structure and values are read with "
    "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's",
)

__all__ = ()
