"""`spectrax_eager.transforms.control_flow`: `spectrax-lib`'s module path
`spectrax.transforms.control_flow`, holding the transforms (`spx`'s)."""

from .._transforms.branches import cond, switch
from .._transforms.loops import fori_loop, remat_scan, while_loop

__all__ = ["cond", "fori_loop", "remat_scan", "switch", "while_loop"]
