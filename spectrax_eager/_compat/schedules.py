"""The schedules as `spx` names: constructors of `spectrax_core.schedules`' classes that also
take the arguments written for `spectrax-lib` (`GPipe(8, False)`, `InterleavedH1(8,
virtual_stages=2, stage_layout="interleaved")`, `DualPipeV(8, zero_bubble=True)`,
`KimiK2(8, extra_warmup=1)`).

`spx.GPipe(8)` is `spectrax_core.schedules.GPipe(microbatches=8)`: one class per schedule name
across the packages, so a schedule compares, hashes and caches alike whichever package
built it (`isinstance` checks take the core class). An argument that only tunes how that
library ran the table is accepted with no effect here; one asking for a different table than
this runtime builds is refused, naming the value that is built.
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


def _named(make, base: type):
    """`make` under `base`'s name and docstring: the `spx` constructor of core class `base`."""
    make.__name__ = make.__qualname__ = base.__name__
    make.__doc__ = (
        f"`spectrax_core.schedules.{base.__name__}`, also from `spectrax-lib`'s arguments.\n\n{base.__doc__}"
    )
    return make


def _flat(base: type):
    def make(microbatches: int, lazy_bwd_batching: bool = False):
        _check_lazy(base.__name__, lazy_bwd_batching)
        return base(microbatches)

    return _named(make, base)


def _interleaved(base: type):
    def make(
        microbatches: int,
        lazy_bwd_batching: bool = False,
        virtual_stages: int = 2,
        stage_layout: str = BUILT_LAYOUT,
    ):
        _check_lazy(base.__name__, lazy_bwd_batching)
        _check_layout(base.__name__, stage_layout)
        return base(microbatches, virtual_stages)

    return _named(make, base)


GPipe = _flat(core.GPipe)
Std1F1B = _flat(core.Std1F1B)
Eager1F1B = _flat(core.Eager1F1B)
ZeroBubbleH1 = _flat(core.ZeroBubbleH1)
InterleavedH1 = _interleaved(core.InterleavedH1)
InterleavedGPipe = _interleaved(core.InterleavedGPipe)
Interleaved1F1BPlusOne = _interleaved(core.Interleaved1F1BPlusOne)


def _dualpipev(microbatches: int, lazy_bwd_batching: bool = False, zero_bubble: bool = True):
    _check_lazy("DualPipeV", lazy_bwd_batching)
    _require(
        "DualPipeV", "zero_bubble", zero_bubble, True, "its warm-up and tail split backwards into I and W"
    )
    return core.DualPipeV(microbatches)


def _kimi(
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
    return core.KimiK2(microbatches, virtual_stages)


DualPipeV = _named(_dualpipev, core.DualPipeV)
KimiK2 = _named(_kimi, core.KimiK2)


def dualpipev_tasks(
    mpmd_dim: int, mpmd_idx: int, n_mubatches: int, *, zero_bubble: bool = True
) -> tuple[core.Action | core.FusedAction, ...]:
    """The actions pipeline rank `mpmd_idx` of `mpmd_dim` runs under `DualPipeV(n_mubatches)`, in
    order: `Action`s and fused forward+backward cells (`FusedAction`, `.fwd` / `.bwd`)."""
    if not 0 <= mpmd_idx < mpmd_dim:
        raise ValueError(f"dualpipev_tasks: mpmd_idx must be in [0, {mpmd_dim}), got {mpmd_idx}.")
    return DualPipeV(n_mubatches, zero_bubble=zero_bubble).actions(mpmd_dim)[mpmd_idx]


#: The schedule classes of `spectrax-lib`'s names (`spx.GPipe`, `spx.runtime.GPipe`, ...).
SCHEDULES = (
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1BPlusOne",
    "InterleavedGPipe",
    "InterleavedH1",
    "KimiK2",
    "Std1F1B",
    "ZeroBubbleH1",
)
__all__ = [*SCHEDULES, "dualpipev_tasks"]
