"""`spectrax_eager.transforms`: `spectrax-lib`'s module path `spectrax.transforms`, holding the
transforms (`spx`'s)."""

from .control_flow import cond, fori_loop, remat_scan, switch, while_loop
from .eval_shape import eval_shape
from .grad import grad, jvp, value_and_grad, vjp
from .jit import jit
from .remat import remat
from .rng_axes import StateAxes, split_rngs, split_stream_keys
from .scan import associative_scan, scan
from .vmap import vmap

__all__ = [
    "StateAxes",
    "associative_scan",
    "cond",
    "eval_shape",
    "fori_loop",
    "grad",
    "jit",
    "jvp",
    "remat",
    "remat_scan",
    "scan",
    "split_rngs",
    "split_stream_keys",
    "switch",
    "value_and_grad",
    "vjp",
    "vmap",
    "while_loop",
]
