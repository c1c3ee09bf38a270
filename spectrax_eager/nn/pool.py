"""`spectrax_eager.nn.pool`: `spectrax-lib`'s module path `spectrax.nn.pool`, holding layers
(`spx.nn`'s)."""

from ._pooling import *
from ._pooling import __all__  # noqa: F401 (the names this path re-exports)
