"""The memory model of per-stage recompute and offload against steps it did not see: device and host
peak bytes per rank within 5%, predicted from the profiles of steps without offload (one keeping
residuals, one recomputing), and offload's effect on the first rank's device peak."""

import functools

import pytest
from planner_cases import MESH, M, init, lm_loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._planner.memory import chosen_memory
from spectrax_mpmd._trace.policy import stage_offload, stage_remat

SCHEDULES = {
    "Std1F1B": S.Std1F1B(microbatches=M),
    "ZeroBubbleH1": S.ZeroBubbleH1(microbatches=M),
    "InterleavedH1": S.InterleavedH1(microbatches=M, virtual_stages=2),
}
CHOICES = {  # (remat, offload) per model stage
    "offload-all": (False, True),
    "mixed": ((False, True, False, False), (True, 0.5, "stash", False)),
    "shares": (False, (0.25, 0.75, "residuals", False)),
}


@functools.cache
def _profiles(name: str) -> dict:
    """The profiles of the schedule's step keeping residuals and recomputing (no offload)."""
    schedule, args = SCHEDULES[name], init()
    stages = schedule.num_model_stages(4)
    return {
        remat: mp.sxvalue_and_grad(lm_loss(stages), mesh=MESH, schedule=schedule, remat=remat).profile_stages(
            *args, rounds=0
        )
        for remat in (False, True)
    }


def _widen(values, stages: int) -> tuple:
    """A per-stage tuple given for 4 stages, repeated over the virtual stages."""
    return values if not isinstance(values, tuple) else tuple(values[s % 4] for s in range(stages))


@pytest.mark.parametrize("choice", sorted(CHOICES))
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_predicted_device_and_host_peaks_equal_the_measured_within_5_percent(name, choice):
    schedule = SCHEDULES[name]
    stages = schedule.num_model_stages(4)
    remat, offload = (_widen(v, stages) for v in CHOICES[choice])
    memory = chosen_memory(_profiles(name), stage_remat(remat, stages), stage_offload(offload, stages))
    predicted = S.simulate(schedule, 4, memory=memory)
    step = mp.sxvalue_and_grad(lm_loss(stages), mesh=MESH, schedule=schedule, remat=remat, offload=offload)
    measured = step.measure_peak_bytes_by_kind(*init())
    for kind, peaks in (("device", predicted.peak_bytes), ("host", predicted.peak_host_bytes)):
        for rank, (p, m) in enumerate(zip(peaks, measured[kind])):
            assert abs(p - m) <= 0.05 * m, (kind, rank, peaks, measured[kind])
    assert any(measured["host"])  # the check is about offloaded bytes too


def test_offloading_every_residual_halves_rank_0s_device_peak_under_1f1b():
    """Std1F1B, 4 ranks, 8 microbatches: rank 0 holds 4 microbatches' residuals at once; offloaded,
    its device peak is at most half, and the bytes it moves are in host memory instead."""
    schedule, args = SCHEDULES["Std1F1B"], init()
    kept, moved = (
        mp.sxvalue_and_grad(lm_loss(4), mesh=MESH, schedule=schedule, offload=off).measure_peak_bytes_by_kind(
            *args
        )
        for off in (False, True)
    )
    assert moved["device"][0] <= kept["device"][0] / 2, (kept, moved)
    assert moved["host"][0] >= kept["device"][0] - moved["device"][0]
    assert not any(kept["host"])
