"""`spectrax_eager.rng`: `spectrax-lib`'s module path `spectrax.rng`, holding random streams (`spx`'s)."""

from .._compat.paths import not_built
from .rngs import Rngs, RngStream, resolve_rngs
from .seed import seed

__getattr__ = not_built(
    __name__,
    "there is no default Rngs: give a seed (spx.Rngs(0)), or set one for a block with `with spx.seed(0):`",
)

__all__ = ["RngStream", "Rngs", "resolve_rngs", "seed"]
