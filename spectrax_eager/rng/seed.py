"""`spectrax_eager.rng.seed`: `spectrax-lib`'s module path `spectrax.rng.seed`, holding random streams
(`spx`'s)."""

from .._compat.paths import not_built
from .._graph.rngs import seed

__getattr__ = not_built(
    __name__,
    "there is no default Rngs: give a seed (spx.Rngs(0)), or set one for a block with `with spx.seed(0):`",
)

__all__ = ["seed"]
