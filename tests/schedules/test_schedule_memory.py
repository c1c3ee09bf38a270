"""`StageMemory` and `peak_bytes`: bytes held over a step, in issue order or simulated time."""

import pytest

from spectrax_core import schedules as S


def memory(n_stages, n_ranks, residual=100, grads=0, inputs=0, params=1000):
    zeros = (0,) * n_stages
    return S.StageMemory(
        inputs=(0,) + (inputs,) * (n_stages - 1),
        kept_inputs=zeros,
        residuals=(residual,) * (n_stages - 1) + (0,),
        grads=(grads,) * (n_stages - 1) + (0,),
        stash=zeros,
        params=(params,) * n_ranks,
        accumulators=(params,) * n_ranks,
        optimizer=(0,) * n_ranks,
        other=(0,) * n_ranks,
    )


@pytest.mark.parametrize("schedule", [S.GPipe(microbatches=4), S.Std1F1B(microbatches=4)])
def test_residuals_follow_the_live_activations(schedule):
    """With residuals only, a rank's peak is its static bytes plus residual x its peak activations
    (the last stage keeps nothing: its loss cell runs forward and backward at once)."""
    mem = memory(4, 4)
    timeline = S.simulate(schedule, 4, memory=mem)
    expected = tuple(2000 + 100 * k for k in timeline.peak_activations[:3]) + (2000,)
    assert timeline.peak_bytes == expected
    assert S.peak_bytes(timeline, mem, order="time") == expected


def test_received_activations_wait_in_issue_order_and_in_time():
    """Rank 1 of GPipe on 2 ranks receives every microbatch's input before its slower forwards
    use them in simulated time; in issue order each is consumed in the round it arrives."""
    mem = memory(2, 2, residual=0, inputs=10)
    timeline = S.simulate(
        S.GPipe(microbatches=3), 2, S.StageCost((1.0, 5.0), (0.0, 0.0), (0.0, 0.0), (0.0, 0.0)), memory=mem
    )
    assert timeline.peak_bytes == (2000, 2010)
    assert S.peak_bytes(timeline, mem, order="time") == (2000, 2030)


def test_no_memory_no_bytes_and_errors():
    assert S.simulate(S.Std1F1B(microbatches=2), 2).peak_bytes is None
    with pytest.raises(ValueError, match="stages"):
        S.simulate(S.Std1F1B(microbatches=2), 2, memory=memory(3, 2))
    with pytest.raises(ValueError, match="ranks"):
        S.simulate(S.Std1F1B(microbatches=2), 2, memory=memory(2, 3))
    with pytest.raises(ValueError, match="order"):
        S.peak_bytes(S.simulate(S.Std1F1B(microbatches=2), 2), memory(2, 2), order="later")
    with pytest.raises(TypeError, match="StageMemory"):
        S.simulate(S.Std1F1B(microbatches=2), 2, memory={"params": 1})
    with pytest.raises(ValueError, match=r"residuals\[1\]"):
        S.StageMemory((0, 0), (0, 0), (0, -1), (0, 0), (0, 0), (1,), (1,), (0,), (0,))
    with pytest.raises(ValueError, match="one byte count per rank"):
        S.StageMemory((0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (1,), (1, 2), (0,), (0,))
