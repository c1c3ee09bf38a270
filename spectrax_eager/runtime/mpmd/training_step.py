"""`spectrax_eager.runtime.mpmd.training_step`: `spectrax-lib`'s module path
`spectrax.runtime.mpmd.training_step`, holding the MPMD entry points (`spx`'s)."""

from ..._pipeline.entry_points import sxvalue_and_grad_and_apply

__all__ = ["sxvalue_and_grad_and_apply"]
