"""The cells a plan is made of: the I/W split, residual reuse, the fused last stage, slot wiring.

Cells are inspected through their jaxprs (`jax.make_jaxpr(spec.fn)(*spec.in_specs)`)
and their compiled executables' XLA cost analysis. The heterogeneous pipeline
has all-distinct widths, so a dot product's output shape says what it computes:
a parameter's shape is a weight gradient, an activation's shape an input cotangent.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import ALL, config_of

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._runtime.slots import Activation
from spectrax_mpmd._trace.jaxpr import sub_jaxprs


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from _eqns(sub)


def _cell_jaxpr(spec):
    return jax.make_jaxpr(spec.fn)(*spec.in_specs).jaxpr


def _dots(spec) -> list[tuple[tuple[int, ...], int]]:
    """`(output shape, flops)` of every dot_general in the cell, nested calls included."""
    out = []
    for eqn in _eqns(_cell_jaxpr(spec)):
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            shape = tuple(eqn.outvars[0].aval.shape)
            out.append((shape, 2 * math.prod(shape) * math.prod(lhs[d] for d in lhs_contract)))
    return out


def _count(spec, primitive: str) -> int:
    return sum(eqn.primitive.name == primitive for eqn in _eqns(_cell_jaxpr(spec)))


def _stage_param_shapes(case, stage: int) -> set[tuple[int, ...]]:
    """Sorted shapes of the parameters of block stage `stage` (any axis order a dot may produce)."""
    return {tuple(sorted(x.shape)) for x in jax.tree.leaves(case.params["blocks"][stage - 1])}


def _flops(step, spec) -> float:
    cost = step.compiler.compile_spec(spec).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


@pytest.fixture(scope="module", params=["ZeroBubbleH1", "DualPipeV"])
def split_case(run_case, request):
    """A 4-stage pipeline whose schedule splits backwards into I and W actions."""
    case = run_case(request.param, *config_of(request.param), False)
    assert case.schedule.splits_backward
    return case, case.step.plan_for(case.params, case.batch)


BLOCK_STAGES = (1, 2)  # the stages of the 4-stage pipeline that have weights and an input activation


@pytest.mark.parametrize("stage", BLOCK_STAGES)
def test_split_backward_i_cell_has_no_weight_gradient_dots(split_case, stage):
    case, plan = split_case
    weights = _stage_param_shapes(case, stage)
    i_dots = _dots(plan.cells[(stage, "I")])
    assert i_dots, "the I cell must compute the input cotangent"
    assert all(tuple(sorted(shape)) not in weights for shape, _ in i_dots), i_dots


@pytest.mark.parametrize("stage", BLOCK_STAGES)
def test_split_backward_w_cell_has_only_weight_gradient_dots(split_case, stage):
    case, plan = split_case
    weights = _stage_param_shapes(case, stage)
    w_dots = _dots(plan.cells[(stage, "W")])
    assert w_dots, "the W cell must compute the weight gradients"
    assert all(tuple(sorted(shape)) in weights for shape, _ in w_dots), w_dots


@pytest.mark.parametrize("stage", BLOCK_STAGES)
def test_split_backward_i_and_w_partition_the_backward(split_case, stage):
    """Dot FLOPs: I + W == B exactly. XLA's whole-program count: I < B, W < B, I + W <= B (+5%)."""
    case, plan = split_case
    dot_flops = {k: sum(f for _, f in _dots(plan.cells[(stage, k)])) for k in "BIW"}
    assert dot_flops["I"] + dot_flops["W"] == dot_flops["B"]
    flops = {k: _flops(case.step, plan.cells[(stage, k)]) for k in "BIW"}
    assert flops["I"] < flops["B"] and flops["W"] < flops["B"], flops
    assert flops["I"] + flops["W"] <= 1.05 * flops["B"], flops


def test_split_backward_first_stage_w_does_all_its_backward(split_case):
    """Stage 0 receives no activation, so it has no input cotangent: its I cell is empty."""
    _, plan = split_case
    i_spec, w_spec = plan.cells[(0, "I")], plan.cells[(0, "W")]
    assert _cell_jaxpr(i_spec).eqns == [] and jax.make_jaxpr(i_spec.fn)(*i_spec.in_specs).out_avals == []
    assert _count(w_spec, "scatter-add") == 1  # the embedding table's gradient


@pytest.mark.parametrize("remat", [False, True])
def test_backward_reuses_residuals_unless_remat(run_case, remat):
    """Saved residuals: B has 2 dots per forward dot and no tanh. remat=True: 3 per dot, tanh recomputed."""
    case = run_case("Std1F1B", 4, 1, remat)
    plan = case.step.plan_for(case.params, case.batch)
    for stage in BLOCK_STAGES:
        f_dots = len(_dots(plan.cells[(stage, "F")]))
        b_dots = len(_dots(plan.cells[(stage, "B")]))
        assert b_dots == (3 if remat else 2) * f_dots, (stage, f_dots, b_dots)
    assert (_count(plan.cells[(1, "B")], "tanh") > 0) == remat


@pytest.mark.parametrize("name", ["Std1F1B", "DualPipeV"])
def test_last_stage_is_one_fused_forward_backward_cell(run_case, name):
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    plan = case.step.plan_for(case.params, case.batch)
    last = n * case.schedule.virtual_stages - 1
    assert {kind for s, kind in plan.cells if s == last} == {"FB"}
    for s in range(last):
        assert {"F", "B"} <= {kind for t, kind in plan.cells if t == s}
        assert "FB" not in {kind for t, kind in plan.cells if t == s}


@pytest.mark.parametrize("name", ALL)
def test_plan_reads_only_written_slots_and_never_a_freed_one(run_case, name):
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    plan = case.step.plan_for(case.params, case.batch)
    live = set(plan.const_slots) | {slot for slot, _ in plan.input_keys}
    for k, (fn, ins, outs, frees) in enumerate(plan.steps):
        assert callable(fn)
        missing = [i for i in ins if i not in live]
        assert not missing, f"step {k} reads slots {missing} that are unwritten or already freed"
        live |= set(outs)
        live -= set(frees)
    assert all(0 <= s < plan.n_slots for _, ins, outs, _ in plan.steps for s in (*ins, *outs))
    assert plan.output_slots["loss"] in live
    assert set(plan.output_slots["grads"].values()) <= live


@pytest.mark.parametrize("name", ALL)
def test_measured_peak_activations_follow_the_schedule(run_case, name):
    """Per rank, the live (stage, microbatch) residuals peak where the schedule's simulation says.

    The last stage's cell is fused (forward and backward at once) and keeps
    nothing, so a rank holding it may stay below the simulated figure.
    """
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    measured = case.step.measure_peak_activations(case.params, case.batch)
    simulated = case.schedule.timeline(n).peak_activations
    last = n * case.schedule.virtual_stages - 1
    holds_last = case.schedule.rank_of(last, n)
    assert len(measured) == n
    for r in range(n):
        if r == holds_last:
            assert measured[r] <= simulated[r], (r, measured, simulated)
        else:
            assert measured[r] == simulated[r], (r, measured, simulated)


def _mlp_loss(params, batch):
    """Stages that begin with a matmul of the activation they receive (which its backward reads)
    and end in tanh (whose output its backward reads)."""
    x, y = batch
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


@pytest.mark.parametrize("name", ["Std1F1B", "ZeroBubbleH1"])
def test_a_forward_never_returns_a_value_its_cell_received(name):
    """A received activation the backward needs is read from its own buffer: the forward returns
    no input of its cell, not even through the stage marker the activation passed, and the
    backward cells read the activation's slot; the step still equals the unsplit one."""
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:4]]
    batch = (jax.random.normal(keys[4], (16, 8)), jax.random.normal(keys[5], (16, 8)))
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    step = mp.sxvalue_and_grad(_mlp_loss, mesh=mesh, schedule=getattr(S, name)(microbatches=4))
    value, grads = step(params, batch)
    want_value, want_grads = jax.value_and_grad(_mlp_loss)(params, batch)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    plan = step.last_plan
    for stage in (1, 2):
        jaxpr = _cell_jaxpr(plan.cells[(stage, "F")])
        received = {id(v) for v in jaxpr.invars}
        for eqn in jaxpr.eqns:  # what passes through a marker is what it received
            if eqn.primitive.name == "sxstage_iter" and {id(v) for v in eqn.invars} <= received:
                received |= {id(v) for v in eqn.outvars}
        assert not {id(v) for v in jaxpr.outvars} & received, stage
    readers: dict = {}
    for _, ins, _, _ in plan.steps:
        for i in ins:
            key = plan.slot_names.get(i)
            if isinstance(key, Activation) and plan.graph.edges[key.edge].dst in (1, 2):
                readers[i] = readers.get(i, 0) + 1
    assert len(readers) == 2 * 4 and min(readers.values()) >= 2, readers  # the forward and a backward
