"""`mp.advise(max_grad_norm=, skip_nonfinite=, validation=)`: the update's validation as the step
will have it. A step guarded by the global gradient norm is timed as
`spectrax_core.schedules.with_update` times its validation on the candidate's own simulated step
(`"post"`: each rank's update right after its own last cell, the step ending no earlier than the
verdict; `"sync"`: every update after the verdict); a transformation that reads other ranks'
gradients itself (a clip inside `tx`) always as `"sync"`; an unguarded, local update as `"none"`.
The chosen step is built with the same settings, and a value the step would not take is refused
before anything is profiled."""

import sys
from dataclasses import replace

import pytest
from planner_cases import MESH, TXS, init, lm_loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._planner.predict import worked
from spectrax_mpmd._planner.profiler import Profiler, UpdateCost

ADVISE = sys.modules["spectrax_mpmd._planner.advise"]
ADVICE = sys.modules["spectrax_mpmd._planner.advice"]
SCHEDULE = S.Std1F1B(microbatches=8)
COMM = 1e-4  # the verdict's two transfers come after the last backward


@pytest.fixture(scope="module")
def posted():
    """An advice for a step clipped by `max_grad_norm` with `validation="post"`, and the profiler
    it used."""
    made = []

    class Kept(Profiler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ADVISE, "Profiler", Kept)
        advice = mp.advise(
            lm_loss(4),
            *init(),
            mesh=MESH,
            schedules=(type(SCHEDULE),),
            microbatches=(8,),
            rounds=1,
            tx=TXS["adamw"],
            comm=COMM,
            search=False,
            max_grad_norm=1.0,
            validation="post",
        )
    (profiler,) = made
    return advice, profiler


def simulated(profiler, issue_s: float):
    """The candidate's simulated step (no update) and its update's seconds per rank, rebuilt from
    the profiles `advise` used: cells timed by one (each for its work: its time alone less the
    issuing `issue_s`), bytes held by the other (its optimizer state included; an unsplit backward
    holds no stash)."""
    timing, holding = profiler.pair(SCHEDULE)
    memory = replace(holding.stages.memory, optimizer=holding.update.state)
    memory = replace(memory, stash=(0,) * memory.stages)
    cost = worked(timing.stages.stage_cost(comm=COMM), issue_s)
    timeline = S.simulate(SCHEDULE, 4, cost, memory=memory)
    return timeline, holding.update


def test_a_post_validated_update_is_timed_by_the_post_model(posted):
    advice, profiler = posted
    (candidate,) = advice.candidates
    timeline, update = simulated(profiler, advice.backend.call_issue_s)
    assert not update.crosses_ranks  # adamw reads its own leaves; the guard needs the global norm
    post = S.with_update(timeline, update.seconds, validation="post")
    sync = S.with_update(timeline, update.seconds, validation="sync")
    scale = advice.calibration.scale  # every predicted time, calibrated on the measured plain step
    assert candidate.schedule_s == pytest.approx(post.makespan * scale)
    assert candidate.step_s >= candidate.schedule_s
    assert candidate.update_s == pytest.approx((post.makespan - timeline.makespan) * scale)
    assert candidate.bubble == timeline.bubble_fraction
    # each rank updates right after its own last cell, not after the verdict: shorter than "sync"
    assert post.makespan < sync.makespan
    assert candidate.schedule_s < sync.makespan * scale


def test_each_validation_is_modelled_on_the_same_profiles(posted):
    _, profiler = posted
    timing, holding = profiler.pair(SCHEDULE)
    rows = {}
    for name in ("sync", "post", "none"):
        inputs = ADVISE._inputs(SCHEDULE, timing, holding, COMM, name)
        (rows[name],) = ADVISE._rows(SCHEDULE, 4, inputs, None, profiler.backend(holding.stages), None)
    timeline, update = simulated(profiler, profiler.backend().call_issue_s)
    for name, row in rows.items():
        assert row.schedule_s == S.with_update(timeline, update.seconds, validation=name).makespan
    assert rows["none"].schedule_s <= rows["post"].schedule_s < rows["sync"].schedule_s
    # a gated update holds the reduced gradients until the verdict, whichever the validation
    assert rows["post"].peak_bytes == rows["sync"].peak_bytes
    assert all(p <= q for p, q in zip(rows["none"].peak_bytes, rows["post"].peak_bytes))
    assert rows["none"].peak_bytes != rows["post"].peak_bytes


@pytest.mark.parametrize(
    "crosses, guarded, given, effective",
    [
        (True, False, "post", "sync"),  # a clip inside tx waits for every rank's gradients
        (True, True, "post", "sync"),
        (True, True, "sync", "sync"),
        (False, True, "post", "post"),  # max_grad_norm / skip_nonfinite as validation= says
        (False, True, "sync", "sync"),
        (False, False, "post", "none"),  # nothing global gates a local update
        (False, False, "sync", "none"),
    ],
)
def test_the_effective_validation_follows_what_gates_the_update(crosses, guarded, given, effective):
    assert UpdateCost((0,), (0.0,), crosses).validation(given, guarded) == effective


def test_the_step_is_built_with_the_advised_validation(posted, monkeypatch):
    advice, _ = posted
    seen = {}
    monkeypatch.setattr(ADVICE, "apply_step", lambda loss, settings, update: seen.update(s=settings, u=update))
    advice.step()
    assert seen["u"].validation == "post" and seen["u"].max_grad_norm == 1.0
    assert seen["u"].skip_nonfinite is False
    assert seen["s"].schedule == advice.best.schedule
    advice.step(TXS["adamw"], validation="sync")  # a keyword given to step wins
    assert seen["u"].validation == "sync" and seen["s"].tx is TXS["adamw"]


@pytest.mark.parametrize("validation", ["none", "later", None, 1])
def test_a_validation_the_step_would_not_take_is_refused_before_any_profile(validation):
    def never(n_stages):
        raise AssertionError("profiled before the arguments were checked")

    allowed = r"\('sync', 'post'\)"
    with pytest.raises(mp.MpmdError, match=rf"advise: validation must be one of {allowed}.*{validation!r}"):
        mp.advise(never, mesh=MESH, validation=validation)


@pytest.mark.parametrize("guard", [{"max_grad_norm": 0.0}, {"max_grad_norm": True}, {"skip_nonfinite": 1}])
def test_a_guard_the_step_would_not_take_is_refused_before_any_profile(guard):
    def never(n_stages):
        raise AssertionError("profiled before the arguments were checked")

    with pytest.raises(mp.MpmdError, match=f"advise: {next(iter(guard))} must be"):
        mp.advise(never, mesh=MESH, **guard)
