"""`spectrax_eager.transforms.eval_shape`: `spectrax-lib`'s module path
`spectrax.transforms.eval_shape`, holding the transforms (`spx`'s)."""

from .._transforms.remat import eval_shape

__all__ = ["eval_shape"]
