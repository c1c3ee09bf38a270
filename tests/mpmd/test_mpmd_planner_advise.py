"""`mp.advise`: every valid configuration simulated with profiled costs and bytes and the optimizer's
update, ranked; under a budget, what it recommends really fits (its top 3 run as whole training
steps, optimizer state included, and measured); one call builds the chosen step, which trains as
the unsplit step does; a budget nothing fits gets the smallest peak and the rank that binds; a
microbatch count that does not divide the batch is skipped with its reason; bad `rounds` is refused
before anything is profiled."""

import re

import jax
import numpy as np
import optax
import pytest
from planner_cases import MESH, TXS, init, lm_loss, measured_with_update

import spectrax_mpmd as mp
from spectrax_core import schedules as S

SCHEDULES = (S.GPipe, S.Std1F1B, S.ZeroBubbleH1, S.InterleavedH1, S.DualPipeV)


def build(n_stages):
    return lm_loss(n_stages), init()


@pytest.fixture(scope="module")
def advice():
    return mp.advise(
        build, mesh=MESH, schedules=SCHEDULES, microbatches=(8,), rounds=1, tx=TXS["clip+adamw"], confirm=0
    )


def test_every_valid_configuration_is_simulated_and_ranked(advice):
    names = {(c.name, c.microbatches, c.virtual_stages) for c in advice.candidates}
    assert names == {
        (cls.__name__, 8, 2 if cls in (S.InterleavedH1, S.DualPipeV) else 1) for cls in SCHEDULES
    } | {("SearchedSchedule", 8, 1)}
    times = [c.step_s for c in advice.candidates]
    assert times == sorted(times) and all(c.fits for c in advice.candidates)
    assert "schedule" in advice.table() and len(advice.as_dict()["candidates"]) == 6
    # the table searched from the flat cut's measured costs is never slower than a named flat one in
    # the schedule's simulation it was searched by (the predicted step also shares the host's compute
    # units among the running cells, which can order two close tables either way)
    simulated = {c.name: c.schedule_s for c in advice.candidates}
    assert simulated["SearchedSchedule"] <= min(simulated[cls.__name__] for cls in SCHEDULES[:3]) * (1 + 1e-9)
    # one profile per layout: flat (ZeroBubbleH1's), interleaved (InterleavedGPipe's), V (DualPipeV's)
    assert advice.profiles == 3 and advice.seconds > 0 and "advised in" in advice.table()
    assert "from tx" in advice.optimizer and "from tx" in advice.table()
    # the clip reads every rank's gradients: every rank's update waits for the last backward
    assert all(0 < c.update_s < c.step_s for c in advice.candidates)


def test_zero_bubble_wins_over_1f1b_where_the_simulation_says_so(advice):
    """On the same cell times ZeroBubbleH1 fills 1F1B's bubble with deferred W cells, so its
    simulated schedule is shorter; the predicted step also counts issuing its extra cells on the
    host's shared compute units, and the ranking follows that predicted step."""
    rows = {c.name: k for k, c in enumerate(advice.candidates)}
    zb, f1b = advice.candidates[rows["ZeroBubbleH1"]], advice.candidates[rows["Std1F1B"]]
    assert zb.schedule_s < f1b.schedule_s
    assert (rows["ZeroBubbleH1"] < rows["Std1F1B"]) == (zb.step_s <= f1b.step_s)


def test_the_top_three_under_a_budget_fit_when_run(advice):
    peaks = sorted(max(c.peak_bytes) for c in advice.candidates)
    limited = advice.under(peaks[2])
    budget = limited.memory_budget
    assert 3 <= len(limited.fitting) < len(limited.candidates)
    assert all(max(c.peak_bytes) > budget for c in limited.candidates if not c.fits)
    assert list(limited.candidates[: len(limited.fitting)]) == list(limited.fitting)  # fitting ones first
    for c in limited.fitting[:3]:
        measured = measured_with_update(c.schedule, "clip+adamw")
        assert max(measured) <= budget, (c, measured)
        assert all(abs(p - q) <= 0.05 * q for p, q in zip(c.peak_bytes, measured))


def test_a_budget_nothing_fits_gets_the_smallest_peak_and_the_binding_rank(advice):
    tiny = advice.under(1000)
    assert not tiny.fitting and len(tiny.candidates) == len(advice.candidates)
    smallest = min(max(c.peak_bytes) for c in tiny.candidates)
    assert max(tiny.smallest_peak.peak_bytes) == smallest
    assert tiny.binding_rank == 0  # the embedding and the wide block
    assert "no configuration fits" in tiny.table() and "rank 0" in tiny.table()


def test_bad_arguments_say_what_to_change():
    with pytest.raises(mp.MpmdError, match="memory_budget"):
        mp.advise(build, mesh=MESH, memory_budget=-1)
    with pytest.raises(
        mp.MpmdError, match="no valid configuration"
    ):  # DualPipeV needs m >= 2n, interleaving m >= n
        mp.advise(build, mesh=MESH, schedules=(S.DualPipeV, S.InterleavedH1), microbatches=(2,))
    loss, args = build(4)  # a function cut into 4 stages: only v = 1 applies
    fixed = mp.advise(
        loss, *args, mesh=MESH, schedules=(S.GPipe, S.InterleavedGPipe), microbatches=(2,), rounds=1
    )
    assert {(c.name, c.virtual_stages) for c in fixed.candidates} == {("GPipe", 1)}


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True, "2"])
def test_rounds_is_checked_before_any_profile(rounds):
    with pytest.raises(mp.MpmdError, match=rf"advise: rounds must be a positive int .*received {rounds!r}"):
        mp.advise(build, mesh=MESH, rounds=rounds)


def test_microbatch_counts_that_do_not_divide_the_batch_are_skipped_with_the_reason():
    """The batch is 32: m = 3 and 5 cannot split it, m = 8 can; the two flat schedules share m."""
    advice = mp.advise(build, mesh=MESH, schedules=(S.GPipe, S.Std1F1B), microbatches=(3, 8, 5), rounds=1)
    assert {(c.name, c.microbatches) for c in advice.candidates} == {("GPipe", 8), ("Std1F1B", 8)}
    assert {(s.name, s.microbatches, s.virtual_stages) for s in advice.skipped} == {
        (name, m, 1) for name in ("GPipe", "Std1F1B") for m in (3, 5)
    }
    for s in advice.skipped:
        assert re.search(rf"batch size 32 .* not divisible by .*microbatches={s.microbatches}", s.reason)
    table = advice.table()
    assert "skipped GPipe, m=3, v=1: " in table and "skipped Std1F1B, m=5, v=1: " in table
    assert len(advice.as_dict()["skipped"]) == 4 and advice.under(None).skipped == advice.skipped
    none = r"no configuration could be profiled(.|\n)*GPipe m=5 v=1: .*divisible"
    with pytest.raises(mp.MpmdError, match=none):
        mp.advise(build, mesh=MESH, schedules=(S.GPipe,), microbatches=(3, 5), rounds=1)


def unsplit_step(tx, params, tokens, targets):
    loss, grads = jax.value_and_grad(lm_loss(1))(params, tokens, targets)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    return loss, optax.apply_updates(params, updates)


def test_one_call_builds_the_chosen_step_which_trains_as_unsplit(advice):
    tx = TXS["clip+adamw"]
    step = advice.step()  # the tx advise was given, the fastest fitting configuration
    params, tokens, targets = advice.arguments()
    loss, new, _ = step(params, tx.init(params), tokens, targets)
    want_loss, want = unsplit_step(tx, *init())
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(mp.MpmdError, match="no configuration fits"):
        advice.under(1000).step()


def test_without_tx_adam_is_assumed_and_said():
    loss, args = build(4)
    plain = mp.advise(loss, *args, mesh=MESH, schedules=(S.Std1F1B,), microbatches=(8,), rounds=1)
    assert "assumed Adam" in plain.optimizer and "assumed Adam" in plain.table()
    none = mp.advise(
        loss, *args, mesh=MESH, schedules=(S.Std1F1B,), microbatches=(8,), rounds=1, optimizer_states=0
    )
    adam = tuple(p + 2 * q + 4 for p, q in zip(none.candidates[0].peak_bytes, (20480, 4096, 4096, 6144)))
    assert plain.candidates[0].peak_bytes == adam  # two moments of each rank's parameters, and a count
    with pytest.raises(mp.MpmdError, match="not both"):
        mp.advise(loss, *args, mesh=MESH, tx=optax.adam(1e-3), optimizer_states=2)
    with pytest.raises(mp.MpmdError, match="Advice.step: pass the optax"):
        plain.step()


def test_the_loss_start_value_is_in_the_loss_ranks_predicted_peak(advice):
    """A loss accumulator starts from a zero the plan keeps as a constant for the whole step, next
    to the running sum; DualPipeV's loss stage is on rank 0, whose peak binds, so a prediction
    without it is exceeded by the measured step."""
    dualpipe = next(c for c in advice.candidates if c.name == "DualPipeV")
    measured = measured_with_update(dualpipe.schedule, "clip+adamw")
    assert measured[0] == max(measured) and measured[0] <= dualpipe.peak_bytes[0], (dualpipe, measured)
