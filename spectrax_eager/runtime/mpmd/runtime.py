"""`spectrax_eager.runtime.mpmd.runtime`: `spectrax-lib`'s module path `spectrax.runtime.mpmd.runtime`,
holding the MPMD entry points (`spx`'s)."""

from ..._compat.paths import not_built
from ..._pipeline.entry_points import sxgrad, sxjit, sxvalue_and_grad
from ..._pipeline.sxcall import sxcall

__getattr__ = not_built(
    __name__,
    "spectrax-lib's MPMD compiler internals are not kept; pipelines compile through sxjit, "
    "sxvalue_and_grad, sxcall and spx.run (spectrax_mpmd.treduce reduces over microbatches), "
    "and loops inside a stage are jax.lax loops",
)

__all__ = ["sxcall", "sxgrad", "sxjit", "sxvalue_and_grad"]
