"""`spectrax_eager.transforms.jit`: `spectrax-lib`'s module path `spectrax.transforms.jit`, holding the
transforms (`spx`'s)."""

from .._transforms.jit import jit

__all__ = ["jit"]
