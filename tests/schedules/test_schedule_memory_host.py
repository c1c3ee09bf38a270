"""Host bytes in the memory model: offloaded residuals and stash held from the cell that makes them to
the start of the last cell that reads them, swept apart from device bytes."""

import dataclasses

import pytest

from spectrax_core import schedules as S


def offloaded(n_stages, n_ranks, host_residual=0, host_stash=0, residual=0):
    zeros = (0,) * n_stages
    return S.StageMemory(
        inputs=zeros,
        kept_inputs=zeros,
        residuals=(residual,) * (n_stages - 1) + (0,),
        grads=zeros,
        stash=zeros,
        params=(1000,) * n_ranks,
        accumulators=(0,) * n_ranks,
        optimizer=(0,) * n_ranks,
        other=(0,) * n_ranks,
        host_residuals=(host_residual,) * (n_stages - 1) + (0,),
        host_stash=(host_stash,) * (n_stages - 1) + (0,),
    )


@pytest.mark.parametrize("schedule", [S.GPipe(microbatches=4), S.Std1F1B(microbatches=4)])
def test_offloaded_residuals_follow_the_live_activations_in_host_memory(schedule):
    """Offloaded residuals are held in host memory as device ones would be (from F to the
    backward), so a rank's host peak is residual x its peak activations; the device keeps only
    its static bytes."""
    timeline = S.simulate(schedule, 4, memory=offloaded(4, 4, host_residual=100))
    assert timeline.peak_host_bytes == tuple(100 * k for k in timeline.peak_activations[:3]) + (0,)
    assert timeline.peak_bytes == (1000,) * 4
    kept = S.simulate(schedule, 4, memory=offloaded(4, 4, residual=100))
    assert kept.peak_host_bytes == (0,) * 4 and kept.peak_bytes == tuple(
        1000 + b for b in timeline.peak_host_bytes
    )


def test_the_stash_is_in_host_memory_from_i_to_w():
    """ZeroBubbleH1 on 2 ranks, 2 microbatches: rank 0's table is F0 F1 I0 W0 I1 W1, so the two
    stashes (I0 to W0, I1 to W1) never meet, while both microbatches' residuals (F to W) and the
    first stash are held together between I0 and W0."""
    schedule = S.ZeroBubbleH1(microbatches=2)
    row = [repr(a) for a in schedule.actions(2)[0]]
    assert row == ["0F0", "0F1", "0I0", "0W0", "0I1", "0W1"]
    timeline = S.simulate(schedule, 2, memory=offloaded(2, 2, host_stash=7))
    assert timeline.peak_host_bytes == (7, 0)
    both = S.simulate(schedule, 2, memory=offloaded(2, 2, host_stash=7, host_residual=100))
    assert both.peak_host_bytes == (207, 0)


def test_host_fields_default_to_zero_and_are_checked():
    base = offloaded(3, 3)
    plain = dataclasses.replace(base, host_residuals=(), host_stash=())
    assert plain.host_residuals == plain.host_stash == (0, 0, 0)
    with pytest.raises(ValueError, match="host_stash must be a tuple with one byte count per stage"):
        dataclasses.replace(base, host_stash=(1, 2))
    timeline = S.simulate(S.GPipe(microbatches=2), 3)
    with pytest.raises(ValueError, match="kind must be 'device' or 'host'"):
        S.peak_bytes(timeline, base, kind="pinned_host")
