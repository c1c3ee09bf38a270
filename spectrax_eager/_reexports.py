"""Pipeline names re-exported by `spx`: the schedule classes (`_schedules`) and entry points
(`_entry_points`).

`sxstage_iter`, `MpmdMesh`, ... come from `spectrax_mpmd`,
imported on first use (`spx.__getattr__`), so `import spectrax_eager` never
depends on the MPMD runtime being importable.
"""

from spectrax_core.schedules import Schedule

from ._entry_points import sxgrad, sxjit, sxstage_region, sxvalue_and_grad, sxvalue_and_grad_and_apply
from ._schedules import (
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    Std1F1B,
    ZeroBubbleH1,
)

__all__ = [
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1BPlusOne",
    "InterleavedGPipe",
    "InterleavedH1",
    "KimiK2",
    "Schedule",
    "Std1F1B",
    "ZeroBubbleH1",
    "sxgrad",
    "sxjit",
    "sxstage_region",
    "sxvalue_and_grad",
    "sxvalue_and_grad_and_apply",
]

MPMD_NAMES = (
    "sxstage_iter",
    "gather",
    "stage_sizes",
    "MpmdMesh",
)
