"""`spectrax_eager.nn.identity`: `spectrax-lib`'s module path `spectrax.nn.identity`, holding layers
(`spx.nn`'s)."""

from .._compat.paths import not_built
from ._activations import Identity

__getattr__ = not_built(
    __name__, "T is a typing variable of spectrax-lib's, not kept; the layer is nn.Identity"
)

__all__ = ["Identity"]
