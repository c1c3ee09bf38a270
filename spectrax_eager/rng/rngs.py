"""`spectrax_eager.rng.rngs`: `spectrax-lib`'s module path `spectrax.rng.rngs`, holding random streams
(`spx`'s)."""

from .._graph.rngs import Rngs, RngStream, resolve_rngs

__all__ = ["RngStream", "Rngs", "resolve_rngs"]
