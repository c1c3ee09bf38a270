"""The advice's confidence statements against steps it never ran.

`mp.advise` runs one real gradient step, plain Std1F1B's, and scales every predicted time so that
step comes out as measured (`Advice.calibration`). Here the whole training steps (optimizer
update included) of the candidates, which the advice never ran, are built and timed; each
calibrated prediction is within `MODEL_ERROR` (25%) of its measured step, and each predicted
ratio between two of them within 25% of the measured ratio: what `print(advice)` states, at the
load the calibration met. The calibration's own step is timed again beside them: when it now
takes more than `STEADY` longer or shorter than it did, or when any step's rounds spread by more
than `STEADY` (other work on the shared cores came and went), the machine is not at the load the
statement is about and the test is skipped, saying so. So it is when a second advice, made after
the timed rounds, predicts some candidate's ratio to the pick more than `STEADY` away from the
first advice's: each layout is profiled at its own moment, and load that came and went while one
was profiled moves that candidate's prediction alone (a model that is wrong is wrong alike in
both). Timings interleave the steps round by round and keep each one's least (load only adds
time), as the calibration's own step is timed.
The statements themselves, and the calibration's arithmetic, are checked on injected times
without timing."""

import time

import jax
import optax
import pytest
from planner_cases import MESH, residual_lm_loss, residual_mlp_lm

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._planner.advice import predicted_confidence, ranked
from spectrax_mpmd._planner.calibrate import Calibration
from spectrax_mpmd._planner.model_error import MODEL_ERROR

ROUNDS = 7
STEADY = 0.2  # the most a step may move, over the rounds or against the calibration, to judge it
SCHEDULES = (S.Std1F1B, S.ZeroBubbleH1, S.InterleavedH1, S.GPipe)


def build(n_stages):
    args = residual_mlp_lm((512,) * 8, d=128, vocab=64, batch=32, length=32, scale=8)
    return residual_lm_loss(mp.stage_sizes(8, n_stages)), args


def advise() -> mp.Advice:
    return mp.advise(
        build, mesh=MESH, schedules=SCHEDULES, microbatches=(8,), rounds=ROUNDS, tx=optax.adam(1e-3),
        confirm=0, search=False, profile_cache=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def advice():
    return advise()


def predicted_ratios(advice, names) -> list[float]:
    """Each of the candidates named `names` predicted step over the first one's, in `advice`."""
    steps = {c.brief(): c.step_s for c in advice.candidates}
    return [steps[name] / steps[names[0]] for name in names]


def round_times(advice, candidates) -> list[list[float]]:
    """The wall seconds of the calibration's own step (plain Std1F1B's gradient step) and of each
    candidate's whole training step in each of `ROUNDS` rounds that run every one once, after a
    warm-up call each."""
    loss, args = build(4)
    calls = [(mp.sxvalue_and_grad(loss, mesh=MESH, schedule=advice.calibration.schedule), args)]
    for c in candidates:
        step = advice.step(candidate=c, donate=False)
        params, *batch = advice.arguments(c)
        calls.append((step, (params, advice.source.tx.init(params), *batch)))
    for step, args in calls:
        jax.block_until_ready(step(*args))
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(ROUNDS):
        for k, (step, args) in enumerate(calls):
            start = time.perf_counter()
            jax.block_until_ready(step(*args))
            times[k].append(time.perf_counter() - start)
    return times


@pytest.mark.slow
@pytest.mark.timing
def test_calibrated_times_and_ratios_hold_on_steps_the_advice_never_ran(advice):
    calibration = advice.calibration
    assert calibration is not None and calibration.schedule == S.Std1F1B(microbatches=8)
    assert "calibrated: x " in str(advice) and "within 25% at that load" in str(advice)
    unseen = [c for c in advice.candidates if c.memory is None]  # whole steps: none was run
    times = round_times(advice, unseen)
    spread = max((max(t) - min(t)) / min(t) for t in times)
    plain, *measured = map(min, times)
    drift = plain / calibration.measured_s - 1
    names = [c.brief() for c in unseen]
    again = zip(predicted_ratios(advice, names), predicted_ratios(advise(), names))
    moved = max(abs(b / a - 1) for a, b in again)
    if spread > STEADY or abs(drift) > STEADY or moved > STEADY:
        pytest.skip(
            f"other work on this machine moved the steps by up to {spread:.0%} over the rounds, the "
            f"calibration's own step by {drift:+.0%} since the advice and a predicted ratio by {moved:.0%} "
            "in a second advice: not the load it was calibrated at"
        )
    for c, seconds in zip(unseen, measured):
        assert abs(c.step_s / seconds - 1) <= MODEL_ERROR, (c.brief(), c.step_s, seconds, drift)
    first, rest = (unseen[0], measured[0]), list(zip(unseen[1:], measured[1:]))
    for c, seconds in rest:
        predicted, actual = c.step_s / first[0].step_s, seconds / first[1]
        assert abs(predicted - actual) <= MODEL_ERROR * actual, (c.brief(), predicted, actual)


def candidate(name: str, step_s: float) -> mp.Candidate:
    schedule = getattr(S, name)(microbatches=8)
    return mp.Candidate(schedule, 8, 1, step_s, 0.1, (1,), True, 0.1 * step_s, schedule_s=0.9 * step_s)


def test_calibration_scales_every_time_alike_and_keeps_the_ranking():
    rows = [candidate("ZeroBubbleH1", 2.0), candidate("Std1F1B", 3.0), candidate("GPipe", 4.0)]
    calibration = Calibration(S.Std1F1B(microbatches=8), measured_s=5.0, modelled_s=2.5)
    scaled = [calibration.applied(c) for c in rows]
    assert calibration.scale == 2.0 and [c.step_s for c in scaled] == [4.0, 6.0, 8.0]
    assert [c.update_s for c in scaled] == pytest.approx([0.4, 0.6, 0.8])
    assert scaled[0].schedule_s == pytest.approx(3.6)
    names = [[c.name for c in ranked(r, None).candidates] for r in (rows, scaled)]
    assert names[0] == names[1]
    says = "x 2.00 to plain Std1F1B m=8's gradient step (5000 ms measured, 2500 modelled)"
    assert calibration.describe() == says


@pytest.mark.parametrize(
    "times, says",
    [
        ((1.0, 1.3), "30% faster than the runner-up, beyond the model's 25% ratio error: it measures faster"),
        ((1.0, 1.1), "within the model's 25% ratio error: either may measure faster"),
        ((1.0,), "the only candidate that fits"),
    ],
)
def test_the_confidence_says_what_the_ratio_error_allows(times, says):
    advice = ranked([candidate(name, t) for name, t in zip(("ZeroBubbleH1", "Std1F1B"), times)], None)
    assert says in predicted_confidence(advice)
