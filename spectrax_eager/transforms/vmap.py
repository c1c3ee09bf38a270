"""`spectrax_eager.transforms.vmap`: `spectrax-lib`'s module path `spectrax.transforms.vmap`, holding
the transforms (`spx`'s)."""

from .._transforms.vmap import vmap

__all__ = ["vmap"]
