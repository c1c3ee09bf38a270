"""Placement: meshes and submeshes, every program on its own rank, stage-local parameter sharding."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpmd_cases import assert_close, config_of, lm_batch, make_schedule, pipelined_lm_loss, tiny_lm

import spectrax_mpmd as mp
from spectrax_core import sharding as core_sharding


def _devices(mesh) -> set:
    return set(np.asarray(mesh.devices).flat)


def _shardings(exe) -> list:
    return [
        s
        for tree in (exe.input_shardings, exe.output_shardings)
        for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    ]


# --- meshes ---------------------------------------------------------------------------------


def test_create_mesh_resolves_the_free_axis_and_drops_pp_in_submeshes():
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")
    assert mesh.is_mpmd and mesh.mpmd_dim == 4
    assert mesh.shape == {"pp": 4, "dp": 1, "fsdp": 2, "ep": 1, "tp": 1, "sp": 1}
    assert isinstance(mesh.jax_mesh, Mesh) and mesh.jax_mesh.axis_names == mesh.axis_names
    subs = [mesh.submesh(r) for r in range(4)]
    assert all(s.axis_names == ("dp", "fsdp", "ep", "tp", "sp") for s in subs)
    assert all(s.devices.size == 2 for s in subs)
    assert set().union(*map(_devices, subs)) == set(jax.devices())
    assert sum(len(_devices(s)) for s in subs) == 8  # disjoint
    assert _devices(subs[1]) == set(np.asarray(mesh.devices)[1].flat)


def test_rank_of_names_the_rank_holding_an_array_or_sharding():
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")
    for rank in range(4):
        sub = mesh.submesh(rank)
        sharded = NamedSharding(sub, P("fsdp"))
        assert mesh.rank_of(sharded) == rank
        assert mesh.rank_of(jax.device_put(np.ones(4), sharded)) == rank
        one = jax.device_put(np.ones(4), sub.devices.flat[-1])
        assert mesh.rank_of(one) == rank
    across = NamedSharding(mesh.jax_mesh, P("pp"))
    assert mesh.rank_of(across) is None
    assert mesh.rank_of(np.ones(3)) is None  # not placed
    other = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
    assert other.rank_of(jax.device_put(np.ones(2), jax.devices()[5])) is None


def test_create_mesh_without_mpmd_axis_and_over_a_device_subset():
    plain = mp.create_mesh((1, 1, -1, 1, 1, 1))
    assert not plain.is_mpmd and plain.mpmd_dim == 1
    sub = mp.create_mesh((2, 1, 1, 1, 2, 1), mpmd_axis="pp", devices=jax.devices()[4:])
    assert _devices(sub.jax_mesh) == set(jax.devices()[4:])
    assert sub.shape["tp"] == 2 and sub.mpmd_dim == 2


def test_a_plain_jax_mesh_with_a_pp_axis_is_accepted(run_case):
    case = run_case("Std1F1B", 4, 1, False)
    step = mp.sxvalue_and_grad(case.step.fn, mesh=case.mesh.jax_mesh, schedule=case.schedule)
    assert step.mesh.mpmd_dim == 4
    assert [_devices(step.mesh.submesh(r)) for r in range(4)] == [
        _devices(case.mesh.submesh(r)) for r in range(4)
    ]


# --- every program on its own rank -----------------------------------------------------------

PLACED = ["Std1F1B", "ZeroBubbleH1", "DualPipeV", "InterleavedH1"]


@pytest.mark.parametrize("name", PLACED)
def test_each_stage_executable_lives_on_its_own_submesh(run_case, name):
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    plan = case.step.plan_for(case.params, case.batch)
    for (stage, kind), spec in plan.cells.items():
        own = _devices(case.mesh.submesh(case.schedule.rank_of(stage, n)))
        for s in _shardings(case.step.compiler.compile_spec(spec)):
            assert s.device_set and s.device_set <= own, (stage, kind, s)


@pytest.mark.parametrize("name", PLACED)
def test_no_compiled_program_spans_two_ranks(run_case, name):
    """Every executable in the plan (cells, accumulator init, gradient sums) runs on one submesh."""
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    plan = case.step.plan_for(case.params, case.batch)
    submeshes = [_devices(case.mesh.submesh(r)) for r in range(n)]
    compiled = [fn for fn, *_ in plan.steps if hasattr(fn, "input_shardings")]
    assert compiled
    for exe in compiled:
        devices = set().union(*(s.device_set for s in _shardings(exe)))
        if not devices:  # a cell with nothing to do (stage 0's I: no input cotangent)
            continue
        assert any(devices <= sub for sub in submeshes), devices
        assert f"num_partitions={len(devices)}" in exe.as_text()


@pytest.mark.parametrize("name", ["Std1F1B", "DualPipeV"])
def test_lowered_cells_have_no_pipeline_axis_and_no_shard_map(run_case, name):
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    plan = case.step.plan_for(case.params, case.batch)
    per_rank = len(_devices(case.mesh.submesh(0)))
    for (stage, kind), spec in plan.cells.items():
        if not jax.make_jaxpr(spec.fn)(*spec.in_specs).out_avals:
            continue  # a cell with nothing to do (stage 0's I: no input cotangent)
        jitted = jax.jit(
            spec.fn,
            in_shardings=tuple(s.sharding for s in spec.in_specs),
            out_shardings=spec.out_shardings,
        )
        text = jitted.lower(*spec.in_specs).as_text()
        assert '"pp"' not in text, (stage, kind)
        assert "manual_computation" not in text and "shard_map" not in text, (stage, kind)
        assert f"mhlo.num_partitions = {per_rank}" in text, (stage, kind)
        hlo = case.step.compiler.compile_spec(spec).as_text()
        assert f"num_partitions={per_rank}" in hlo, (stage, kind)


@pytest.mark.parametrize("name", PLACED)
def test_gradients_come_back_on_the_owner_rank(run_case, name):
    """Embedding grads on stage 0's rank, block k's on stage k+1's rank, the head's on the last stage's."""
    n, v = config_of(name)
    case = run_case(name, n, v, False)
    last = n * case.schedule.virtual_stages - 1

    def on(stage):
        return _devices(case.mesh.submesh(case.schedule.rank_of(stage, n)))

    for leaf in jax.tree.leaves(case.grads["embed"]):
        assert leaf.sharding.device_set == on(0)
    for k, block in enumerate(case.grads["blocks"]):
        for leaf in jax.tree.leaves(block):
            assert leaf.sharding.device_set == on(k + 1), (k, leaf.sharding)
    assert case.grads["head"].sharding.device_set == on(last)


# --- stage-local sharding: pp=2, fsdp=2, tp=2 --------------------------------------------------


@pytest.fixture(scope="module")
def sharded_lm():
    """The core LM on 2 ranks of (fsdp=2, tp=2), default rules, activations batch-sharded on fsdp."""
    mesh = mp.create_mesh((2, 1, 2, 1, 2, 1), mpmd_axis="pp")
    lm = tiny_lm(jax.random.key(3), n_layers=2, tie_embeddings=False)
    batch = lm_batch(jax.random.key(4), 8)
    loss_fn = pipelined_lm_loss((1, 1), sharding=P("fsdp"))
    rules = core_sharding.Rules.default()
    step = mp.sxvalue_and_grad(loss_fn, mesh=mesh, schedule=make_schedule("Std1F1B", 2), rules=rules)
    loss, grads = step(lm, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_fn))(lm, batch)
    specs = core_sharding.param_specs(lm, rules, mesh=mesh.submesh(0))
    return mesh, lm, batch, step, loss, grads, ref_loss, ref_grads, specs


def test_sharded_stages_match_the_reference(sharded_lm):
    _, _, _, _, loss, grads, ref_loss, ref_grads, _ = sharded_lm
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def _spec_leaves(specs):
    """One PartitionSpec per parameter leaf (absent fields such as `bias=None` hold no leaf)."""
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def test_gradients_are_sharded_per_the_rules_on_the_owner_submesh(sharded_lm):
    mesh, _, _, _, _, grads, _, _, specs = sharded_lm
    owner = mesh.submesh(0)  # stage 0 reads every leaf but the head and the final norm
    spec_leaves = _spec_leaves(specs)
    grad_leaves = jax.tree.leaves(grads)
    assert len(spec_leaves) == len(grad_leaves)
    sharded = 0
    for path_grad, spec in zip(jax.tree.leaves_with_path(grads), spec_leaves):
        path, g = path_grad
        name = jax.tree_util.keystr(path)
        sub = mesh.submesh(1) if (".head" in name or name.startswith(".norm")) else owner
        expected = NamedSharding(sub, spec)
        assert g.sharding.is_equivalent_to(expected, g.ndim), (name, g.sharding, expected)
        sharded += g.sharding.shard_shape(g.shape) != g.shape
    assert sharded >= 10  # nearly every leaf is split over the rank's 4 devices


def test_every_cell_reads_parameters_sharded_per_the_rules(sharded_lm):
    """Each compiled step that reads parameter leaf `a` on rank `r` gets it with the rule's spec there."""
    mesh, lm, batch, step, *_, specs = sharded_lm
    plan = step.plan_for(lm, batch)
    spec_leaves = _spec_leaves(specs)
    avals = jax.tree.leaves(lm)
    param_slots = {slot: (a, r) for slot, (kind, a, r) in plan.input_keys if kind == "param"}
    assert {r for a, r in param_slots.values()} == {0, 1}
    checked = 0
    for fn, ins, _, _ in plan.steps:
        if not hasattr(fn, "input_shardings"):
            continue
        in_shardings = jax.tree.leaves(
            fn.input_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        for pos, slot in enumerate(ins):
            if slot in param_slots:
                a, r = param_slots[slot]
                expected = NamedSharding(mesh.submesh(r), spec_leaves[a])
                assert in_shardings[pos].is_equivalent_to(expected, avals[a].ndim), (a, r, in_shardings[pos])
                checked += 1
    assert checked >= len(avals)


def test_activation_arrives_with_the_marker_sharding(sharded_lm):
    """`sxstage_iter(x, sharding=P("fsdp"))`: the last stage's cell receives x batch-sharded on fsdp."""
    mesh, lm, batch, step, *_ = sharded_lm
    plan = step.plan_for(lm, batch)
    spec = plan.cells[(1, "FB")]
    acts = [s for s in spec.in_specs if s.shape == (4, 4, 16)]  # (microbatch, length, d_model)
    assert len(acts) == 1
    expected = NamedSharding(mesh.submesh(1), P("fsdp"))
    assert acts[0].sharding.is_equivalent_to(expected, 3)
    exe = step.compiler.compile_spec(spec)
    in_shardings = jax.tree.leaves(
        exe.input_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
    )
    assert in_shardings[list(spec.in_specs).index(acts[0])].is_equivalent_to(expected, 3)
