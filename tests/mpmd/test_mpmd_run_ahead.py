"""Bounded run-ahead: a rank never has more than `SPECTRAX_MPMD_RUN_AHEAD` cells issued ahead of its
oldest unfinished one (the runtime's own count, per rank), the results are those of the unbounded
loop, and the planner's run-ahead term is what `limit - 1` queued cells of a rank's largest stage
hold, added to its predicted peaks under a bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._env import RUN_AHEAD_ENV, configured_run_ahead
from spectrax_mpmd._planner.backend import BackendCost, CopyFit
from spectrax_mpmd._planner.memory import run_ahead_bytes
from spectrax_mpmd._planner.predict import predictor

# a backend whose copies and calls cost nothing: the peaks do not depend on it
FREE = BackendCost(CopyFit(0.0, 1e12, ()), CopyFit(0.0, 1e12, ()), 0.0, 0.0, 1.0, 4)
MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
M = 8


def loss(params, x):
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean(x**2)


def arguments():
    keys = jax.random.split(jax.random.key(0), 5)
    return [jax.random.normal(k, (8, 8)) / 3 for k in keys[:4]], jax.random.normal(keys[4], (16, 8))


def run(monkeypatch, limit, schedule):
    monkeypatch.setenv(RUN_AHEAD_ENV, str(limit))
    step = mp.sxvalue_and_grad(loss, mesh=MESH, schedule=schedule)
    out = step(*arguments())
    return out, step.last_plan


@pytest.fixture(scope="module")
def unbounded():
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {name: run(monkeypatch, "none", cls(microbatches=M))[0] for name, cls in SCHEDULES.items()}


SCHEDULES = {"GPipe": S.GPipe, "Std1F1B": S.Std1F1B}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("limit", [1, 2, 3])
def test_no_rank_runs_further_ahead_than_the_limit_and_the_results_are_unchanged(
    monkeypatch, unbounded, name, limit
):
    (value, grads), plan = run(monkeypatch, limit, SCHEDULES[name](microbatches=M))
    assert plan.run_ahead == limit
    assert len(plan.outstanding) == 4 and max(plan.outstanding) == limit, plan.outstanding
    want_value, want_grads = unbounded[name]
    np.testing.assert_array_equal(value, want_value)
    for a, b in zip(grads, want_grads):
        np.testing.assert_array_equal(a, b)


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(RUN_AHEAD_ENV, raising=False)
    assert configured_run_ahead() == (None if jax.default_backend() == "cpu" else 2)
    monkeypatch.setenv(RUN_AHEAD_ENV, "2")
    assert configured_run_ahead() == 2
    monkeypatch.setenv(RUN_AHEAD_ENV, "None")
    assert configured_run_ahead() is None
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(RUN_AHEAD_ENV, bad)
        with pytest.raises(mp.MpmdError, match=RUN_AHEAD_ENV):
            configured_run_ahead()


MEMORY = dict(
    inputs=(0, 1, 2, 3, 4, 5, 6, 7),
    kept_inputs=(10,) * 8,
    residuals=(100, 200, 100, 200, 100, 200, 100, 900),
    grads=(1,) * 8,
    stash=(0,) * 8,
    params=(0,) * 4,
    accumulators=(0,) * 4,
    optimizer=(0,) * 4,
    other=(0,) * 4,
)


def test_the_planner_term_is_what_the_queued_cells_of_a_ranks_largest_stage_hold():
    memory = S.StageMemory(**MEMORY)
    schedule = S.InterleavedH1(microbatches=8, virtual_stages=2)
    held = [memory.inputs[s] + 10 + memory.residuals[s] + 1 for s in range(8)]
    per_rank = [0] * 4
    for s in range(8):
        per_rank[schedule.rank_of(s, 4)] = max(
            per_rank[schedule.rank_of(s, 4)], held[schedule.model_stage(s, 4)]
        )
    assert run_ahead_bytes(memory, schedule, 4, 1) == (0, 0, 0, 0)
    assert run_ahead_bytes(memory, schedule, 4, 3) == tuple(2 * b for b in per_rank)
    with pytest.raises(ValueError, match="positive number of cells"):
        run_ahead_bytes(memory, schedule, 4, None)


def test_the_planners_peaks_include_the_term_under_a_bound(monkeypatch):
    schedule = S.Std1F1B(microbatches=8)
    memory = S.StageMemory(**{k: v[:4] if len(v) == 8 else v for k, v in MEMORY.items()})
    cost = S.StageCost(*((1.0,) * 4,) * 4)
    peaks = {}
    for bound in ("none", "3"):
        monkeypatch.setenv(RUN_AHEAD_ENV, bound)
        peaks[bound] = predictor(schedule, 4, (0.0,) * 4, "none", FREE)(memory, cost).peaks
    extra = run_ahead_bytes(memory, schedule, 4, 3)
    assert peaks["3"] == tuple(p + e for p, e in zip(peaks["none"], extra)) and min(extra) > 0
