"""`spectrax_eager.transforms.grad`: `spectrax-lib`'s module path `spectrax.transforms.grad`, holding
the transforms (`spx`'s)."""

from .._transforms.autodiff import grad, jvp, value_and_grad, vjp

__all__ = ["grad", "jvp", "value_and_grad", "vjp"]
