"""`spectrax_eager.runtime.schedules.zero_bubble`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.zero_bubble`, holding the pipeline schedules (`spx`'s)."""

from ..._compat.schedules import ZeroBubbleH1

__all__ = ["ZeroBubbleH1"]
