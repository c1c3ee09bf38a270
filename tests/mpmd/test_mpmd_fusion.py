"""Fused cells: consecutive cells of one rank run as one program, with the values of the unsplit
function. A plan issues fewer calls than it has cell steps, gives `jax.value_and_grad`'s loss and
gradients (and, with an optax update in the plan, the unsplit update), and its step-by-step
measurements still see every cell."""

import jax
import jax.numpy as jnp
import optax
import pytest
from mpmd_cases import assert_close

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._comm import is_transfer
from spectrax_mpmd._env import FUSE_ENV, RUN_AHEAD_ENV
from spectrax_mpmd._plan.fusion import runs, trimmed, wiring
from spectrax_mpmd._runtime.plan import Step

D, B, LAYERS = 8, 16, 4


def mlp_loss(params, batch, cut: bool):
    x, y = batch
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w["w"] + w["b"])
        if cut and k < LAYERS - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


def case():
    keys = jax.random.split(jax.random.key(3), LAYERS + 2)
    params = [{"w": jax.random.normal(k, (D, D)) / 3, "b": jnp.full((D,), 0.1)} for k in keys[:LAYERS]]
    return params, (jax.random.normal(keys[-2], (B, D)), jax.random.normal(keys[-1], (B, D)))


# (ranks, schedule): every schedule on one rank (its stages virtual there), and two ranks, where a
# rank's only run of cells (a backward meeting another) holds programs that also run alone
SCHEDULES = {
    "Std1F1B": (1, lambda: S.Std1F1B(microbatches=4)),
    "GPipe": (1, lambda: S.GPipe(microbatches=4)),
    "ZeroBubbleH1": (1, lambda: S.ZeroBubbleH1(microbatches=4)),
    "InterleavedH1(v=4)": (1, lambda: S.InterleavedH1(microbatches=4, virtual_stages=4)),
    "2 ranks InterleavedH1(v=2)": (2, lambda: S.InterleavedH1(microbatches=4, virtual_stages=2)),
}


def step_of(name: str, apply: bool = False):
    n, make = SCHEDULES[name]
    schedule = make()
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    cut = n * schedule.virtual_stages > 1

    def loss(p, b):
        return mlp_loss(p, b, cut)

    if apply:
        return mp.sxvalue_and_grad_and_apply(loss, optax.adam(1e-2), mesh=mesh, schedule=schedule)
    return mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule)


def fused_and_alone(plan) -> tuple[set, set]:
    """The programs of the plan's cells that run inside a fused call, and the programs it issues
    (transfers aside: those the plan issues together are `test_mpmd_moves`')."""
    inside = set()
    for k, st in enumerate(plan.steps):
        call = plan.hot_steps[plan.issued_of[k]] if plan.issued_of else st
        if call.fn is not st.fn and not is_transfer(st.fn):
            inside.add(st.fn)
    return inside, {st.fn for st in plan.hot_steps if not is_transfer(st.fn)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_fused_plan_issues_fewer_calls_with_the_unsplit_values(name):
    params, batch = case()
    step = step_of(name)
    loss, grads = step(params, batch)
    want_loss, want_grads = jax.value_and_grad(lambda p, b: mlp_loss(p, b, False))(params, batch)
    assert_close(loss, want_loss, rtol=1e-5)
    assert_close(grads, want_grads, rtol=1e-5)
    plan = step.plan_for(params, batch)
    fused, alone = fused_and_alone(plan)
    assert not alone & fused, "no cell's program compiles both alone and inside a fused one"
    if SCHEDULES[name][0] == 1:
        assert 0 < len(plan.hot_steps) < len(plan.steps), "consecutive cells of a rank run as one program"
        assert len(plan.issued_of) == len(plan.steps)
    else:
        calls = [st[:3] for st in plan.hot_steps if not is_transfer(st.fn)]
        alone = [st[:3] for st in plan.steps if not is_transfer(st.fn)]
        assert calls == alone, "its one run's ends also run alone: no cell is fused"


@pytest.mark.parametrize("name", ["InterleavedH1(v=4)", "2 ranks InterleavedH1(v=2)"])
def test_an_optax_update_fused_into_the_plan_is_the_unsplit_update(name):
    params, batch = case()
    tx = optax.adam(1e-2)
    train = step_of(name, apply=True)
    state = tx.init(params)
    want_loss, grads = jax.value_and_grad(lambda p, b: mlp_loss(p, b, False))(params, batch)
    updates, want_state = tx.update(grads, state, params)
    want = optax.apply_updates(params, updates)
    loss, got, got_state = train(jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), batch)
    assert_close(loss, want_loss, rtol=1e-5)
    assert_close(got, want, rtol=1e-5)
    assert_close(got_state, want_state, rtol=1e-5)


@pytest.mark.parametrize("limit", [1, 2])
def test_a_bounded_run_ahead_counts_a_fused_program_as_one_cell(monkeypatch, limit):
    monkeypatch.setenv(FUSE_ENV, "8")  # several fused programs on the rank
    monkeypatch.setenv(RUN_AHEAD_ENV, str(limit))
    params, batch = case()
    step = step_of("InterleavedH1(v=4)")
    loss, grads = step(params, batch)
    want_loss, want_grads = jax.value_and_grad(lambda p, b: mlp_loss(p, b, False))(params, batch)
    assert_close(loss, want_loss, rtol=1e-5)
    assert_close(grads, want_grads, rtol=1e-5)
    plan = step.plan_for(params, batch)
    assert len(plan.hot_steps) > 2 and plan.outstanding == [limit]
    programs = [k for k, st in enumerate(plan.hot_steps) if not hasattr(st.fn, "targets")]
    assert [k for k, r in enumerate(plan.gates.ends) if r == 0] == programs, "each program ends a cell"


def test_one_cell_per_program_when_fusion_is_off(monkeypatch):
    monkeypatch.setenv(FUSE_ENV, "1")
    params, batch = case()
    step = step_of("InterleavedH1(v=4)")
    assert_close(step(params, batch)[1], jax.grad(lambda p, b: mlp_loss(p, b, False))(params, batch))
    plan = step.plan_for(params, batch)
    assert plan.hot_steps is plan.steps and plan.issued_of == ()


def test_measurements_replay_every_cell_of_a_fused_plan():
    params, batch = case()
    step = step_of("InterleavedH1(v=4)")
    step(params, batch)
    plan = step.plan_for(params, batch)
    assert step.measure_peak_activations(params, batch) == [plan.schedule.peak_activations(1)]
    timeline = step.measure_timeline(params, batch)
    assert sum(len(row) for row in timeline.events) == sum(
        end > first for *_, first, end in plan.action_steps
    )
    assert step.profile(params, batch, rounds=1).cells == sum(
        len(cell.split("&")) for *_, cell in plan.log if cell != "-"
    )


class Spec:
    """A stand-in cell spec: devices from its shardings, donated positions."""

    def __init__(self, devices, donate=()):
        sharding = jax.sharding.SingleDeviceSharding(devices)
        self.in_specs = (jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding),)
        self.out_shardings, self.donate = (sharding,), donate


def test_runs_stop_at_transfers_other_devices_and_the_limit(monkeypatch):
    from spectrax_mpmd._plan import fusion

    monkeypatch.setattr(fusion, "CellSpec", Spec)
    a, b = jax.devices()[:2]
    cell = lambda d: Step(Spec(d), (0,), (1,))
    steps = [cell(a), cell(a), Step(object(), (1,), (2,)), cell(a), cell(b), cell(b), cell(b), cell(a)]
    assert runs(steps, limit=8) == [(0, 2), (4, 7)]
    assert runs(steps, limit=2) == [(0, 2), (4, 6)]


def test_a_run_leaves_out_ends_whose_program_also_runs_alone():
    # a run ending in a program that runs alone elsewhere loses that end; a run left with one
    # item is dropped, and its item then runs alone too, trimming another run's end in turn
    assert trimmed([(0, 3), (4, 7)], ["b", "c", "d", None, "a", "e", "f", "a"]) == [(0, 3), (5, 7)]
    assert trimmed([(0, 2), (3, 5)], ["p", "q", None, "q", "r", None, "r"]) == []
    assert trimmed([(0, 3)], ["p", "q", "p"]) == [(0, 3)], "a program inside runs only is kept"


def test_wiring_reads_first_uses_returns_what_is_read_later_and_keeps_donations():
    acc = Spec(jax.devices()[0], donate=(1,))
    acc.in_specs = acc.in_specs * 2
    steps = [
        Step(acc, (10, 11), (11, 12)),  # reads x, donates the accumulator, makes y
        Step(acc, (12, 11), (11, 13)),  # reads y (made inside), the accumulator again
    ]
    w = wiring(steps, 0, 2, kept={11}, last_read={13: 5})
    assert [w.slots[n] for n in w.arguments] == [10, 11]
    assert [w.slots[n] for n in w.results] == [11, 13]  # y stays inside: nothing after reads it
    assert w.donated == (1,)


@pytest.mark.parametrize("name", ["Std1F1B", "GPipe", "InterleavedH1(v=4)"])
def test_the_planner_counts_a_fused_run_as_one_call(name):
    from spectrax_mpmd._env import configured_fuse_cells
    from spectrax_mpmd._planner.issued import issued_calls

    params, batch = case()
    step = step_of(name)
    plan = step.plan_for(params, batch)
    programs = [st for st in plan.hot_steps if not hasattr(st.fn, "targets")]
    assert issued_calls(plan.schedule, 1, configured_fuse_cells()) == len(programs)


def test_the_default_runs_a_one_rank_step_as_one_program(monkeypatch):
    monkeypatch.setitem(SCHEDULES, "m=8", (1, lambda: S.InterleavedH1(microbatches=8, virtual_stages=4)))
    params, batch = case()
    plan = step_of("m=8").plan_for(params, batch)
    programs = [st for st in plan.hot_steps if not hasattr(st.fn, "targets")]
    cells = [k for k, (fn, *_) in enumerate(plan.steps) if not hasattr(fn, "targets")]
    assert len(programs) == 1 and len(cells) > 32


@pytest.mark.parametrize("fuse", ["1", "8", None])
def test_the_issued_specs_are_the_programs_the_plan_issues(monkeypatch, fuse):
    """Each issued step's spec, compiled by `jax.jit`, run in the plan's order on its buffers,
    gives the plan's results (what benchmarks time `jax.jit`'s own dispatch of)."""
    if fuse is not None:
        monkeypatch.setenv(FUSE_ENV, fuse)
    params, batch = case()
    step = step_of("InterleavedH1(v=4)")
    plan = step.plan_for(params, batch)
    assert len(plan.issued_specs) == len(plan.hot_steps)
    leaves = jax.tree.leaves((params, batch))
    placed = lambda: jax.device_put([leaves[key.leaf] for _, key in plan.input_keys], plan.input_shardings)
    want = plan.run(placed())
    buf = plan.buffers(placed())
    empty = set(range(plan.n_slots)) - {slot for slot, _ in plan.input_keys} - set(plan.const_slots)
    assert all(buf[slot] is None for slot in empty), "each call starts from fresh buffers"
    for (fn, ins, outs, frees), spec in zip(plan.hot_steps, plan.issued_specs):
        assert (spec is None) == hasattr(fn, "targets")
        run = fn if spec is None else jax.jit(spec.fn, donate_argnums=spec.donate)
        for o, r in zip(outs, run(*[buf[i] for i in ins])):
            buf[o] = r
        for f in frees:
            buf[f] = None
    for slots in jax.tree.leaves(plan.output_slots):
        assert_close(buf[slots], want[slots], rtol=1e-6)
