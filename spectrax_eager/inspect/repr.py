"""`spectrax_eager.inspect.repr`: `spectrax-lib`'s module path `spectrax.inspect.repr`, holding
inspection helpers (`spx.inspect`'s)."""

from . import repr_module

__all__ = ["repr_module"]
