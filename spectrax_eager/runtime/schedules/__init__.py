"""`spectrax_eager.runtime.schedules`: `spectrax-lib`'s module path `spectrax.runtime.schedules`,
holding the pipeline schedules (`spx`'s)."""

from ..._compat.paths import not_built
from .base import Action, FusedTask, Schedule
from .dualpipe import DualPipeV, dualpipev_tasks
from .gpipe import GPipe
from .interleaved import Interleaved1F1BPlusOne, InterleavedGPipe, InterleavedH1, KimiK2
from .one_f_one_b import Eager1F1B, Std1F1B
from .zero_bubble import ZeroBubbleH1

__getattr__ = not_built(
    __name__,
    "which forward and backward run fused is the schedule's table (KimiK2, DualPipeV); "
    "spectrax_core.schedules holds the actions and the simulator",
)

__all__ = [
    "Action",
    "DualPipeV",
    "Eager1F1B",
    "FusedTask",
    "GPipe",
    "Interleaved1F1BPlusOne",
    "InterleavedGPipe",
    "InterleavedH1",
    "KimiK2",
    "Schedule",
    "Std1F1B",
    "ZeroBubbleH1",
    "dualpipev_tasks",
]
