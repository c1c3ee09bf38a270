"""`spectrax_eager.transforms.rng_axes`: `spectrax-lib`'s module path `spectrax.transforms.rng_axes`,
holding the transforms (`spx`'s)."""

from .._graph.rngs import split_rngs, split_stream_keys
from .._transforms.vmap import StateAxes

__all__ = ["StateAxes", "split_rngs", "split_stream_keys"]
