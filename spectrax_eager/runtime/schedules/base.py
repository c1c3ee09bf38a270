"""`spectrax_eager.runtime.schedules.base`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.base`, holding the pipeline schedules (`spx`'s)."""

from spectrax_core.schedules import Action, Schedule

from ..._compat.paths import not_built
from .. import FusedTask

__getattr__ = not_built(
    __name__,
    "which forward and backward run fused is the schedule's table (KimiK2, DualPipeV); "
    "spectrax_core.schedules holds the actions and the simulator",
)

__all__ = ["Action", "FusedTask", "Schedule"]
