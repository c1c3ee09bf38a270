"""`spectrax_eager.transforms.remat`: `spectrax-lib`'s module path `spectrax.transforms.remat`, holding
the transforms (`spx`'s)."""

from .._transforms.remat import remat

__all__ = ["remat"]
