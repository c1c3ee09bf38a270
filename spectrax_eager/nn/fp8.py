"""`spectrax_eager.nn.fp8`: `spectrax-lib`'s module path `spectrax.nn.fp8`, holding layers
(`spx.nn`'s)."""

from .._compat.paths import not_built
from ._fp8 import Fp8Linear, Fp8Meta

__getattr__ = not_built(
    __name__,
    "the FP8 layer is nn.Fp8Linear with its Fp8Meta, and spectrax-lib's quantization helpers "
    "and typing variables are not kept",
)

__all__ = ["Fp8Linear", "Fp8Meta"]
