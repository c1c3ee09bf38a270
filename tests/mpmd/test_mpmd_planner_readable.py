"""What `advise` shows and keeps: a short summary (`print(advice)`), a table of one line per candidate
within 120 characters with variants labelled, every shipped schedule a candidate by default, profiles
kept on disk keyed by the program (a second advice reads them back, another program does not), the
pick made by measurement only when close candidates and a budget call for it, and the one-plan step
measuring its peak bytes per memory kind as the gradient step does."""

import optax
import pytest
from planner_cases import HIDDEN, MESH, init, lm_loss, residual_lm_loss, residual_mlp_lm

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._planner import advise as ADVISE
from spectrax_mpmd._planner.advice import Advice, Candidate
from spectrax_mpmd._planner.confirm import contenders
from spectrax_mpmd._planner.memory import _spans

KWARGS = dict(
    mesh=MESH, schedules=(S.Std1F1B, S.ZeroBubbleH2, S.VHalf), microbatches=(8,), rounds=1, confirm=0
)


def build(n_stages):
    return lm_loss(n_stages), init()


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """The same advice twice on one profile cache directory, and the directory."""
    directory = tmp_path_factory.mktemp("profiles")
    first = mp.advise(build, profile_cache=directory, **KWARGS)
    return first, mp.advise(build, profile_cache=directory, **KWARGS), directory


@pytest.mark.slow
def test_the_table_is_one_short_line_per_candidate_with_variants_labelled(cached):
    advice, _, _ = cached
    table = advice.table()
    assert all(len(line) <= 120 for line in table.splitlines()), max(map(len, table.splitlines()))
    labels = [(c.label, c.microbatches, c.virtual_stages) for c in advice.candidates]
    assert len(labels) == len(set(labels))  # ZeroBubbleH2 once per latency, named by it
    assert {c.label for c in advice.candidates if c.name == "ZeroBubbleH2"} == {
        f"ZeroBubbleH2 lat {x}" for x in (0.0, 0.5, 1.0)
    }
    assert all(c.label[:22] in table for c in advice.candidates)
    summary = str(advice)
    assert summary.startswith("pick: ") and "why: bubble" in summary and "advised in" in summary
    assert len(summary.splitlines()) <= 7 and advice.best.brief() in summary
    assert all(c.limit in ("schedule", "host thread", "shared devices") for c in advice.candidates)
    assert all(c.step_s >= c.schedule_s for c in advice.candidates)


@pytest.mark.slow
def test_profiles_are_read_back_from_disk_for_the_same_program_only(cached, tmp_path):
    first, second, directory = cached
    assert first.cached == 0 and second.cached == second.profiles == first.profiles > 0
    # the same peaks read back; the rows' order follows the predicted times, measured anew each time
    assert sorted(c.peak_bytes for c in first.candidates) == sorted(c.peak_bytes for c in second.candidates)
    assert "from the disk cache" in second.table()
    wider = residual_mlp_lm((2 * HIDDEN[0], *HIDDEN[1:]), d=16, vocab=32, batch=32, length=8, scale=4)
    other = mp.advise(residual_lm_loss(mp.stage_sizes(8, 4)), *wider, profile_cache=directory, **KWARGS)
    assert other.cached == 0  # another program: its own key
    off = mp.advise(build, profile_cache=False, **{**KWARGS, "schedules": (S.Std1F1B,)})
    assert off.cached == 0


def test_every_shipped_schedule_is_a_candidate_by_default():
    made = {type(s) for s in ADVISE._candidates(ADVISE.ALL, (8,), (1, 2), 4)}
    assert {S.ZBV, S.VHalf, S.VMin, S.ZeroBubbleH2, S.DualPipe, S.DualPipeV} <= made
    assert set(S.ALL_SCHEDULES) <= made


def _row(name, seconds, fits, memory=None):
    schedule = getattr(S, name)(microbatches=8)
    return Candidate(schedule, 8, 1, seconds, 0.1, (100,), fits, 0.0, memory)


def test_close_fitting_candidates_are_measured_only_when_the_default_does_not_fit():
    rows = [_row("ZeroBubbleH1", 1.0, True), _row("GPipe", 1.2, True), _row("Eager1F1B", 1.3, True)]
    fitting_default = Advice((*rows, _row("Std1F1B", 1.1, True)), 100, rows[0])
    assert contenders(fitting_default, 3) == []  # the pick is never predicted slower than it
    tight = Advice((*rows, _row("Std1F1B", 0.9, False)), 100, rows[0])
    assert contenders(tight, 3) == rows[:2]  # within 25% of the fastest: 1.0 and 1.2, not 1.3
    assert contenders(tight, 1) == rows[:1]
    assert contenders(Advice(tuple(rows), None, rows[0]), 3) == []  # no budget: nothing to confirm


def test_memory_labels_name_stage_spans():
    assert _spans([0, 1, 2, 5]) == "0-2,5" and _spans([3]) == "3" and _spans([]) == ""


@pytest.mark.slow
def test_the_one_plan_step_measures_peak_bytes_per_kind(cached):
    advice, _, _ = cached
    tx = optax.adamw(1e-3)
    step = advice.step(tx, donate=False)
    params, *batch = advice.arguments()
    args = (params, tx.init(params), *batch)
    by_kind = step.measure_peak_bytes_by_kind(*args)
    assert set(by_kind) == {"device", "host"} and by_kind["device"] == step.measure_peak_bytes(*args)
    assert all(b == 0 for b in by_kind["host"])  # nothing offloaded


def test_confirm_must_be_a_count():
    with pytest.raises(mp.MpmdError, match="confirm must be an int >= 0"):
        mp.advise(build, mesh=MESH, confirm=-1)
