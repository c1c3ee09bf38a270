"""`spx.runtime`: the pipeline runtime's user-facing names in one place.

The schedule classes come from `spectrax_core.schedules`; the entry points
(`sxjit`, `sxcall`, `sxgrad`, `sxvalue_and_grad`), the stage markers
(`sxstage_iter`, `sxstage_region`) and the mesh type (`MpmdMesh`) from
`spectrax_mpmd`, imported on first use.
"""

from __future__ import annotations

from typing import Any

from spectrax_core.schedules import (
    Action,
    DualPipeV,
    Eager1F1B,
    FusedAction,
    GPipe,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    Schedule,
    Std1F1B,
    ZeroBubbleH1,
)

#: The fused forward+backward cell of a schedule table (`FusedAction` here).
FusedTask = FusedAction

MPMD_NAMES = ("sxjit", "sxcall", "sxgrad", "sxvalue_and_grad", "sxstage_iter", "sxstage_region", "MpmdMesh")


def __getattr__(name: str) -> Any:
    if name in MPMD_NAMES:
        import spectrax_mpmd

        return getattr(spectrax_mpmd, name)
    raise AttributeError(f"module 'spectrax_eager.runtime' has no attribute {name!r}")


__all__ = [
    "Action",
    "DualPipeV",
    "Eager1F1B",
    "FusedAction",
    "FusedTask",
    "GPipe",
    "Interleaved1F1BPlusOne",
    "InterleavedGPipe",
    "InterleavedH1",
    "KimiK2",
    "Schedule",
    "Std1F1B",
    "ZeroBubbleH1",
    *MPMD_NAMES,
]
