"""`spectrax_eager.nn.recurrent`: `spectrax-lib`'s module path `spectrax.nn.recurrent`, holding layers
(`spx.nn`'s)."""

from ._recurrent import *
from ._recurrent import __all__  # noqa: F401 (the names this path re-exports)
