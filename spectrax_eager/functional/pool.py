"""`spectrax_eager.functional.pool`: `spectrax-lib`'s module path `spectrax.functional.pool`, holding
functional ops (`spx.functional`'s)."""

from . import avg_pool, max_pool, pool

__all__ = ["avg_pool", "max_pool", "pool"]
