"""`spectrax_eager.runtime.schedules.dualpipe`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.dualpipe`, holding the pipeline schedules (`spx`'s)."""

from ..._compat.schedules import DualPipeV, dualpipev_tasks

__all__ = ["DualPipeV", "dualpipev_tasks"]
