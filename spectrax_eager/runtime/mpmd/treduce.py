"""`spectrax_eager.runtime.mpmd.treduce`: `spectrax-lib`'s module path `spectrax.runtime.mpmd.treduce`;
none of its names is built here, and importing one says what to use."""

from ..._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "spectrax-lib's MPMD compiler internals are not kept; pipelines compile through sxjit, "
    "sxvalue_and_grad, sxcall and spx.run (spectrax_mpmd.treduce reduces over microbatches), "
    "and loops inside a stage are jax.lax loops",
)

__all__ = ()
