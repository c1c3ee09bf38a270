"""Pipeline names re-exported by `spx`: the schedule classes from `spectrax_core.schedules`.

`sxstage_iter`, `sxjit`, ... come from `spectrax_mpmd`,
imported on first use (`spx.__getattr__`), so `import spectrax_eager` never
depends on the MPMD runtime being importable.
"""

from spectrax_core.schedules import (
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    Schedule,
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
]

MPMD_NAMES = (
    "sxstage_iter",
    "sxstage_region",
    "gather",
    "stage_sizes",
    "sxjit",
    "sxgrad",
    "sxvalue_and_grad",
    "MpmdMesh",
)
