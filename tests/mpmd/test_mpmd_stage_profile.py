"""`step.profile_stages`: per-stage costs read from the compiled cells, bytes per rank and edge,
measured cell times; profiling leaves the step's results unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import make_schedule

import spectrax_mpmd as mp
from spectrax_core import schedules as S

D, B, M = 16, 16, 4
MB = B // M


def mlp_loss(params, batch):
    x, y = batch
    h = x
    for k, layer in enumerate(params):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if k < len(params) - 1:
            h = mp.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


def case():
    keys = jax.random.split(jax.random.key(0), 6)
    params = [{"w": jax.random.normal(k, (D, D)) / 4, "b": jnp.zeros((D,))} for k in keys[:4]]
    batch = (jax.random.normal(keys[4], (B, D)), jax.random.normal(keys[5], (B, D)))
    return params, batch


MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])


@pytest.fixture(scope="module", params=["Std1F1B", "ZeroBubbleH1", "remat"])
def profiled(request):
    name = "Std1F1B" if request.param == "remat" else request.param
    step = mp.sxvalue_and_grad(
        mlp_loss, mesh=MESH, schedule=make_schedule(name, M), remat=request.param == "remat"
    )
    params, batch = case()
    before = step(params, batch)
    profile = step.profile_stages(params, batch, rounds=2)
    return request.param, step, (params, batch), before, profile


def test_profiling_leaves_the_results_unchanged(profiled):
    _, step, args, before, _ = profiled
    after = step(*args)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bytes_per_rank_and_per_edge(profiled):
    _, _, _, _, profile = profiled
    layer = (D * D + D) * 4
    assert profile.param_bytes == (layer,) * 4
    assert profile.accumulator_bytes == (layer, layer, layer, layer + 4)  # the loss on the last rank
    assert sorted(profile.edges) == [(s, s + 1, MB * D * 4) for s in range(3)]


def test_cells_are_the_ones_that_run_with_costs_from_xla(profiled):
    name, step, args, _, profile = profiled
    plan = step.plan_for(*args)
    assert {(c.stage, c.kind) for c in profile.cells} == set(plan.ran)
    kinds = {c.kind for c in profile.cells if c.stage == 0}
    assert kinds == (
        {"F", "W"} if name == "ZeroBubbleH1" else {"F", "B"}
    )  # stage 0 has no I: no input cotangent
    assert profile.cell(3, "FB").rank == 3
    for c in profile.cells:
        assert c.seconds is not None and c.seconds > 0
        assert c.bytes_accessed > 0 and c.argument_bytes > 0
    forward = profile.cell(1, "F")
    assert forward.flops >= 2 * MB * D * D  # the stage's matmul, at least
    assert forward.argument_bytes >= (D * D + D + MB * D) * 4


def test_saved_bytes_follow_residuals_and_remat(profiled):
    name, _, _, _, profile = profiled
    forwards = [c for c in profile.cells if c.kind == "F"]
    if name == "remat":  # the backward recomputes from the stage's inputs: a forward keeps nothing
        assert all(c.saved_bytes == 0 for c in forwards)
    else:  # tanh(h @ w + b) keeps at least its output for the backward; never the weight itself
        assert all(MB * D * 4 <= c.saved_bytes < (D * D + MB * D) * 4 for c in forwards)
    assert all(c.saved_bytes == 0 for c in profile.cells if c.kind in ("B", "W", "FB"))


def test_table_and_dict(profiled):
    _, _, _, _, profile = profiled
    assert "gradient accumulators" in profile.table()
    assert len(profile.as_dict()["cells"]) == len(profile.cells)


def test_profile_stages_function_builds_the_step():
    params, batch = case()
    profile = mp.profile_stages(
        mlp_loss, params, batch, mesh=MESH, schedule=make_schedule("GPipe", M), rounds=1
    )
    assert {c.kind for c in profile.cells} == {"F", "B", "FB"}


def test_stage_cost_carries_the_measured_cells_into_the_simulator(profiled):
    name, step, _, _, profile = profiled
    cost = profile.stage_cost(comm=1e-5)
    last = 3
    assert cost.F[last] == profile.cell(last, "FB").seconds and cost.B[last] == 0.0
    for s in range(last):
        assert cost.F[s] == profile.cell(s, "F").seconds
        if name == "ZeroBubbleH1":
            i = profile.cell(s, "I").seconds if s > 0 else 0.0  # stage 0 has no input cotangent
            assert cost.W[s] == profile.cell(s, "W").seconds and cost.B[s] == pytest.approx(i + cost.W[s])
        else:
            assert cost.B[s] == profile.cell(s, "B").seconds and cost.I[s] == cost.W[s] == cost.B[s] / 2
    timeline = S.simulate(step.schedule, 4, cost)
    assert timeline.busy[last] == pytest.approx(M * cost.F[last])
