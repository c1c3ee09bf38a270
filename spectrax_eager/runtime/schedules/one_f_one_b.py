"""`spectrax_eager.runtime.schedules.one_f_one_b`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.one_f_one_b`, holding the pipeline schedules (`spx`'s)."""

from ..._compat.schedules import Eager1F1B, Std1F1B

__all__ = ["Eager1F1B", "Std1F1B"]
