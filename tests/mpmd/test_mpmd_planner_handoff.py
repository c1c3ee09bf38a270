"""From the planner to a training loop: `mp.runner(advice=...)` builds the advised configuration's
runner, whose whole step trains as the unsplit step does; `balance` counts the optimizer's state
against a memory budget by default (from `tx`, else Adam assumed) and says so."""

import jax
import numpy as np
import optax
import pytest
from planner_cases import MESH, init, residual_lm_loss

import spectrax_core as sc
import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM
from spectrax_mpmd._planner.advice import Advice, Candidate, Source
from spectrax_mpmd._planner.balance import _optimizer_copies

PAIR = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def _advice(schedule, tx, fits: bool = True) -> Advice:
    """An advice of one candidate on 2 ranks (as `mp.advise` returns it, without profiling anything)."""
    chosen = Candidate(schedule, schedule.microbatches, schedule.virtual_stages, 1.0, 0.0, (1,) * 2, fits)
    source = Source(fn=None, args=(), settings=mp.StepSettings("advise", mesh=PAIR, tx=tx))
    return Advice((chosen,), None if fits else 1, chosen, source=source)


@pytest.mark.parametrize(
    "schedule", [S.Std1F1B(microbatches=4), S.InterleavedH1(microbatches=4, virtual_stages=2)]
)
def test_the_runner_of_an_advice_trains_as_unsplit(schedule):
    # a clip (it reads every rank's gradients) and momentum; Adam's first step divides each gradient
    # by its own magnitude, which turns fp32 rounding of a gradient near its eps into any difference
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))
    model = TransformerLM.init(jax.random.key(0), vocab_size=32, d_model=8, n_layers=4, n_heads=2, d_ff=32)
    tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, 32)
    targets = jax.random.randint(jax.random.key(2), (8, 8), 0, 32)
    loss_of = lambda m: softmax_cross_entropy(sc.apply(m, tokens), targets)  # noqa: E731
    want_loss, grads = jax.jit(jax.value_and_grad(loss_of))(model)
    updates, _ = tx.update(grads, tx.init(model), model)
    want = optax.apply_updates(model, updates)

    step = mp.runner(advice=_advice(schedule, tx), loss_fn=softmax_cross_entropy)
    assert step.runner.schedule == schedule
    assert float(optax.tree.norm(grads)) > 0.5, "the clip must be active"
    loss, new, _ = step.update(model, tx.init(model), tokens, targets)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_a_runner_from_advice_refuses_a_second_mesh_or_an_advice_nothing_fits():
    advice = _advice(S.Std1F1B(microbatches=4), optax.sgd(0.1))
    with pytest.raises(mp.MpmdError, match="advice= gives the mesh and the schedule"):
        mp.runner(advice=advice, schedule=S.GPipe(microbatches=4), loss_fn=softmax_cross_entropy)
    with pytest.raises(mp.MpmdError, match="no configuration fits"):
        mp.runner(advice=_advice(S.Std1F1B(microbatches=4), None, fits=False), loss_fn=softmax_cross_entropy)
    with pytest.raises(mp.MpmdError, match="mesh= is required"):
        mp.runner(loss_fn=softmax_cross_entropy)


def test_balance_counts_the_optimizer_state_by_default():
    params = init()[0]
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert (
        _optimizer_copies(None, None, params)[0] == 2
        and "assumed Adam" in _optimizer_copies(None, None, params)[1]
    )
    adam, note = _optimizer_copies(optax.adam(1e-3), None, params)
    assert adam == pytest.approx((2 * nbytes + 4) / nbytes) and "from tx" in note  # two moments and a count
    assert _optimizer_copies(optax.sgd(0.1), None, params)[0] == 0
    assert _optimizer_copies(optax.adam(1e-3), 1.5, params)[0] == 1.5
    sizes = (2, 2, 2, 2)
    balance = mp.balance(
        lambda s: (residual_lm_loss(s), init()),
        mesh=MESH,
        schedule=S.Std1F1B(microbatches=8),
        n_blocks=8,
        memory_budget=1 << 30,
        rounds=1,
    )
    assert (
        "assumed Adam" in balance.optimizer
        and "assumed Adam" in balance.table()
        and len(balance.sizes) == len(sizes)
    )
