"""The schedule classes as `spx` names: `spectrax_core.schedules`' classes, also taking the
arguments written for `spectrax-lib` (`GPipe(8, False)`, `InterleavedH1(8, virtual_stages=2,
stage_layout="interleaved")`, `DualPipeV(8, zero_bubble=True)`, `KimiK2(8, extra_warmup=1)`).

Each is a subclass of the core class (so `isinstance` and the runtime see the core's
schedule); it builds the same table. An argument that only tunes how that library ran the
table is accepted with no effect here; one asking for a different table than this runtime
builds is refused, naming the value that is built.
"""

from __future__ import annotations

from spectrax_core import schedules as core
from spectrax_core.schedules import ScheduleError

#: The stage layout the interleaved schedules build: logical stage s on rank s mod n.
BUILT_LAYOUT = "interleaved"
_LAYOUTS = ("contiguous", "interleaved", "loop")


def _check_lazy(name: str, lazy_bwd_batching) -> None:
    """`lazy_bwd_batching` chose when that library issued backwards (one batched call per stage
    at the end); this runtime issues them as the table says, with the same results."""
    if not isinstance(lazy_bwd_batching, bool):
        raise TypeError(
            f"{name}: lazy_bwd_batching (the second positional argument) must be True or False, got "
            f"{lazy_bwd_batching!r}; pass virtual_stages= by keyword."
        )


def _require(name: str, keyword: str, value, built, why: str) -> None:
    if value != built:
        raise ScheduleError(
            f"{name}: {keyword}={value!r} is not built here ({why}); pass {keyword}={built!r}."
        )


def _check_layout(name: str, stage_layout) -> None:
    if stage_layout not in _LAYOUTS:
        raise ScheduleError(f"{name}: stage_layout must be one of {_LAYOUTS}, got {stage_layout!r}.")
    _require(
        name, "stage_layout", stage_layout, BUILT_LAYOUT, "rank r holds logical stages r, r+n, ..., r+(v-1)n"
    )


def _subclass(base: type, __init__) -> type:
    """`base` under its own name, built with `__init__` (which takes the seed's arguments)."""
    return type(
        base.__name__, (base,), {"__init__": __init__, "__doc__": base.__doc__, "__module__": __name__}
    )


def _flat(base: type) -> type:
    def __init__(self, microbatches: int, lazy_bwd_batching: bool = False):
        _check_lazy(base.__name__, lazy_bwd_batching)
        base.__init__(self, microbatches)

    return _subclass(base, __init__)


def _interleaved(base: type) -> type:
    def __init__(
        self,
        microbatches: int,
        lazy_bwd_batching: bool = False,
        virtual_stages: int = 2,
        stage_layout: str = BUILT_LAYOUT,
    ):
        _check_lazy(base.__name__, lazy_bwd_batching)
        _check_layout(base.__name__, stage_layout)
        base.__init__(self, microbatches, virtual_stages)

    return _subclass(base, __init__)


GPipe = _flat(core.GPipe)
Std1F1B = _flat(core.Std1F1B)
Eager1F1B = _flat(core.Eager1F1B)
ZeroBubbleH1 = _flat(core.ZeroBubbleH1)
InterleavedH1 = _interleaved(core.InterleavedH1)
InterleavedGPipe = _interleaved(core.InterleavedGPipe)
Interleaved1F1BPlusOne = _interleaved(core.Interleaved1F1BPlusOne)


class DualPipeV(core.DualPipeV):
    __doc__ = core.DualPipeV.__doc__

    def __init__(self, microbatches: int, lazy_bwd_batching: bool = False, zero_bubble: bool = True):
        _check_lazy("DualPipeV", lazy_bwd_batching)
        _require(
            "DualPipeV", "zero_bubble", zero_bubble, True, "its warm-up and tail split backwards into I and W"
        )
        super().__init__(microbatches)


def dualpipev_tasks(
    mpmd_dim: int, mpmd_idx: int, n_mubatches: int, *, zero_bubble: bool = True
) -> tuple[core.Action | core.FusedAction, ...]:
    """The actions pipeline rank `mpmd_idx` of `mpmd_dim` runs under `DualPipeV(n_mubatches)`, in
    order: `Action`s and fused forward+backward cells (`FusedAction`, `.fwd` / `.bwd`)."""
    if not 0 <= mpmd_idx < mpmd_dim:
        raise ValueError(f"dualpipev_tasks: mpmd_idx must be in [0, {mpmd_dim}), got {mpmd_idx}.")
    return DualPipeV(n_mubatches, zero_bubble=zero_bubble).actions(mpmd_dim)[mpmd_idx]


class KimiK2(core.KimiK2):
    __doc__ = core.KimiK2.__doc__

    def __init__(
        self,
        microbatches: int,
        lazy_bwd_batching: bool = False,
        virtual_stages: int = 2,
        stage_layout: str = BUILT_LAYOUT,
        extra_warmup: int = 1,
        split_backward: bool = False,
    ):
        _check_lazy("KimiK2", lazy_bwd_batching)
        _check_layout("KimiK2", stage_layout)
        _require("KimiK2", "extra_warmup", extra_warmup, 1, "one extra warm-up forward per rank")
        _require("KimiK2", "split_backward", split_backward, False, "each steady F/B pair is one fused cell")
        super().__init__(microbatches, virtual_stages)


__all__ = [
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1BPlusOne",
    "InterleavedGPipe",
    "InterleavedH1",
    "KimiK2",
    "Std1F1B",
    "ZeroBubbleH1",
    "dualpipev_tasks",
]
