"""`mp.advise` under a budget no plain configuration fits: it chooses, per stage, offload and recompute
with the schedule, reports their predicted cost, and the step it builds fits when run (device and host
peaks within 5% of the prediction) and trains as the unsplit step does."""

import jax
import numpy as np
import optax
import pytest
from planner_cases import MESH, TXS, init, lm_loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S

TX = TXS["adamw"]
SCHEDULES = (S.Std1F1B, S.ZeroBubbleH1)


def build(n_stages):
    return lm_loss(n_stages), init()


@pytest.fixture(scope="module")
def advised():
    """A budget 60% of the smallest plain peak, and the advice under it."""
    kwargs = dict(mesh=MESH, schedules=SCHEDULES, microbatches=(8,), virtual_stages=(1,), rounds=1, tx=TX)
    plain = mp.advise(build, search=False, **kwargs)
    budget = int(0.6 * min(max(c.peak_bytes) for c in plain.candidates))
    return plain, budget, mp.advise(build, search=False, memory_budget=budget, **kwargs)


def test_a_configuration_that_fits_is_found_with_its_choice_and_cost(advised):
    plain, budget, advice = advised
    assert not plain.under(budget).fitting  # no plain configuration fits
    best = advice.best
    assert best.memory is not None and max(best.peak_bytes) <= budget
    assert any(o for o in best.memory.offload) or any(best.memory.remat)
    assert best.memory.transfer_s > 0 or best.memory.recompute_s > 0
    assert best.memory.bandwidth > 0 and len(best.memory.remat) == 4
    assert best.memory.label() in advice.table() and advice.as_dict()["candidates"][0]["memory"] is not None
    plain_rows = [c for c in advice.candidates if c.memory is None]
    assert {c.name for c in plain_rows} == {cls.__name__ for cls in SCHEDULES} and not any(
        c.fits for c in plain_rows
    )


def test_the_chosen_step_fits_when_run_and_the_prediction_holds(advised):
    _, budget, advice = advised
    best = advice.best
    step = mp.sxvalue_and_grad(
        lm_loss(4), mesh=MESH, schedule=best.schedule, remat=best.memory.remat, offload=best.memory.offload
    )
    apply = advice.step()
    params, tokens, targets = advice.arguments()
    measured = apply.measure_peak_bytes(params, TX.init(params), tokens, targets)
    assert max(measured) <= budget
    for p, m in zip(best.peak_bytes, measured):
        assert abs(p - m) <= 0.05 * m, (best.peak_bytes, measured)
    host = step.measure_peak_bytes_by_kind(*init())["host"]
    for p, m in zip(best.memory.host_peak_bytes, host):
        assert abs(p - m) <= 0.05 * max(m, 1), (best.memory.host_peak_bytes, host)


def test_the_chosen_step_trains_as_unsplit(advised):
    *_, advice = advised
    params, tokens, targets = advice.arguments()
    loss, new, _ = advice.step()(params, TX.init(params), tokens, targets)
    params, tokens, targets = init()
    want_loss, grads = jax.value_and_grad(lm_loss(1))(params, tokens, targets)
    updates, _ = TX.update(grads, TX.init(params), params)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(optax.apply_updates(params, updates))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
