"""`spx.run(stage_sizes="auto")` balances with `spectrax_mpmd`'s one balancer and every setting
of the run: the microbatch weights reach the profiled step, and a memory budget rules out the
splits that do not fit, as `spectrax_mpmd`'s own choice on the same profile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_mpmd._planner import balance as balancer

SCHEDULE = spx.GPipe(2)


class Net(spx.Module):
    """Four blocks of unequal sizes, so that a tight budget leaves one split."""

    def __init__(self, rngs):
        widths = (8, 32, 8, 8, 8)
        self.blocks = spx.nn.ModuleList(
            [spx.nn.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])]
        )
        self.head = spx.nn.Linear(8, 4, rngs=rngs)

    def forward(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.head(x)


def loss_fn(out, y):
    return jnp.mean((out - y) ** 2)


def weight(inputs, y):
    return jnp.sum(jnp.abs(inputs)) + 1.0


@pytest.fixture
def seen(monkeypatch):
    """What the balancer was handed and what it chose, per call."""
    calls = []
    real_step, real_profile = balancer.balance_step, balancer.balance_from_profile

    def balance_step(fn, n_blocks, settings, options):
        calls.append({"settings": settings})
        calls[-1]["chosen"] = real_step(fn, n_blocks, settings, options)
        return calls[-1]["chosen"]

    def balance_from_profile(profile, schedule, n, **kwargs):
        calls[-1].update(profile=profile, schedule=schedule, n=n, kwargs=kwargs)
        return real_profile(profile, schedule, n, **kwargs)

    monkeypatch.setattr(balancer, "balance_step", balance_step)
    monkeypatch.setattr(balancer, "balance_from_profile", balance_from_profile)
    return calls


def _run(**kwargs):
    model = Net(spx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(1), (8, 8)), jax.random.normal(jax.random.key(2), (8, 4))
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
    common = dict(inputs=x, targets=y, mesh=mesh, loss_fn=loss_fn, schedule=SCHEDULE, stage_sizes="auto")
    loss, _ = spx.run(model, microbatch_weight_fn=weight, **common, **kwargs)
    assert np.isfinite(float(loss))
    return x, y


def _mpmd_choice(call: dict, budget: float):
    """`spectrax_mpmd`'s split of `call`'s profile under `budget` (None where nothing fits)."""
    kwargs = dict(call["kwargs"], memory_budget=budget)
    try:
        return balancer.balance_from_profile(call["profile"], call["schedule"], call["n"], **kwargs).sizes
    except mp.StageSplitError:
        return None


def test_auto_stage_sizes_honour_the_weights_and_the_memory_budget(seen):
    x, y = _run()
    (free,) = seen
    step = free["settings"]
    assert step.memory_budget is None and step.schedule == SCHEDULE
    w = step.microbatch_weight_fn  # the run's weight, read from the step's arguments
    assert w is not None and float(w(None, None, x, y)) == float(weight(x, y))

    low, high = 0.0, 1e9  # the smallest budget some split fits: one split is left
    assert _mpmd_choice(free, high) is not None
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (low, mid) if _mpmd_choice(free, mid) is not None else (mid, high)
    budget = high
    tight = _mpmd_choice(free, budget)
    assert _mpmd_choice(free, low) is None

    _run(memory_budget=budget)
    bound = seen[-1]
    assert bound["settings"].memory_budget == budget == bound["kwargs"]["memory_budget"]
    assert bound["settings"].microbatch_weight_fn is not None
    assert bound["chosen"].sizes == tight == _mpmd_choice(bound, budget)
