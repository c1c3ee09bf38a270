"""`spectrax_eager.inspect.display`: `spectrax-lib`'s module path `spectrax.inspect.display`, holding
inspection helpers (`spx.inspect`'s)."""

from . import display

__all__ = ["display"]
