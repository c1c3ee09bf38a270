"""Host-cost machinery: fast transfers, programs loaded onto other ranks, build timings, the
host-cost report. Every fast path must give what its public fallback gives."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpmd_cases import make_schedule

import spectrax_mpmd as mp
from spectrax_mpmd._comm.local import _Copy, fast_path_available, is_transfer, same_layout
from spectrax_mpmd._compile.compiler import Compiler
from spectrax_mpmd._compile.relocate import relocation_available
from spectrax_mpmd._runtime.slots import LossAccumulator

D, B, LAYERS = 16, 16, 4


def mlp_loss(params, batch, v=1, spec=None):
    x, y = batch
    h = x
    for k, layer in enumerate(params):
        z = h @ layer["w"]
        if v == 2:
            z = mp.sxstage_iter(z, sharding=spec)
        h = jnp.tanh(z + layer["b"])
        if k < len(params) - 1:
            h = mp.sxstage_iter(h, sharding=spec)
    return jnp.mean((h - y) ** 2)


def mlp_case():
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [{"w": jax.random.normal(k, (D, D)) / 4, "b": jnp.full((D,), 0.1)} for k in keys[:LAYERS]]
    batch = (jax.random.normal(keys[-2], (B, D)), jax.random.normal(keys[-1], (B, D)))
    return params, batch


def mlp_steps(name, sharded=False):
    """The MLP on 4 ranks: one device each, or (sharded) 2 devices each with the activations
    split over them (multi-device programs and sharded sends)."""
    devices = jax.devices()[: 8 if sharded else 4]
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp", devices=devices)
    schedule = make_schedule(name, 8, v=2)
    spec = P("fsdp") if sharded else None
    fn = lambda p, bt: mlp_loss(p, bt, schedule.virtual_stages, spec)  # noqa: E731
    return lambda: mp.sxvalue_and_grad(fn, mesh=mesh, schedule=schedule), mlp_case()


CASES = {
    "Std1F1B": lambda: mlp_steps("Std1F1B"),
    "ZeroBubbleH1": lambda: mlp_steps("ZeroBubbleH1"),
    "DualPipeV": lambda: mlp_steps("DualPipeV"),
    "sharded": lambda: mlp_steps("Std1F1B", sharded=True),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def built(request):
    """A step with every fast path on, the same step with relocation off, and its arguments."""
    make, args = CASES[request.param]()
    fast, plain = make(), make()
    plain.compiler = Compiler(relocate=False)
    return fast, plain, args


def _bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_relocated_programs_equal_fresh_compiles(built):
    fast, plain, args = built
    _bitwise_equal(fast(*args), plain(*args))
    stats, plain_stats = fast.timings(*args), plain.timings(*args)
    assert plain_stats["relocated"] == 0
    if relocation_available():
        assert stats["relocated"] > 0
        assert stats["compiled"] < plain_stats["compiled"]
        assert stats["compiled"] + stats["relocated"] == plain_stats["compiled"]


def test_fast_transfers_equal_public_transfers(built):
    fast, _, args = built
    entry, leaves = fast._entry(args)
    placed = entry.place(fast.placer, leaves)
    plan = entry.plan
    public = plan.with_public_transfers()
    moves = [fn for fn, *_ in plan.steps if is_transfer(fn)]
    assert moves and not any(isinstance(fn, _Copy) for fn, *_ in public.steps)
    if fast_path_available():
        assert any(isinstance(fn, _Copy) for fn in moves)
    got, want = plan.run(placed), public.run(placed)
    kept = [k for k, (a, b) in enumerate(zip(got, want)) if a is not None or b is not None]
    assert kept
    for k in kept:
        assert got[k].sharding == want[k].sharding, k
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


def test_same_layout_is_a_per_shard_copy_and_nothing_else():
    devices = jax.devices()
    mesh = lambda ds: jax.sharding.Mesh(np.array(ds).reshape(2, 2), ("fsdp", "tp"))  # noqa: E731
    a, b = mesh(devices[0:4]), mesh(devices[4:8])
    one = lambda d: NamedSharding(jax.sharding.Mesh(np.array([d]), ("x",)), P())  # noqa: E731
    assert same_layout(one(devices[0]), one(devices[1]))
    assert same_layout(jax.sharding.SingleDeviceSharding(devices[0]), one(devices[1]))
    assert same_layout(NamedSharding(a, P("fsdp")), NamedSharding(b, P("fsdp", None)))
    assert not same_layout(NamedSharding(a, P("fsdp")), NamedSharding(b, P("tp")))
    assert not same_layout(NamedSharding(a, P()), NamedSharding(b, P("tp")))
    flipped = jax.sharding.Mesh(np.array(devices[4:8]).reshape(2, 2), ("tp", "fsdp"))
    assert not same_layout(NamedSharding(a, P("fsdp")), NamedSharding(flipped, P("fsdp")))
    assert not same_layout(one(devices[0]), NamedSharding(b, P()))


def test_unused_arguments_in_other_positions_are_other_programs():
    """Two cells that read different arguments but lower to the same text once unused
    arguments are dropped must not share an executable."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = jax.ShapeDtypeStruct((3,), jnp.float32, sharding=sharding)
    compiler = Compiler()
    from spectrax_mpmd._compile.compiler import CellSpec

    first = CellSpec(lambda x, y, z: (x + z,), (spec,) * 3, (sharding,))
    second = CellSpec(lambda x, y, z: (y + z,), (spec,) * 3, (sharding,))
    xs = [jnp.full(3, v, jnp.float32) for v in (1.0, 10.0, 100.0)]
    assert float(compiler.compile_spec(first)(*xs)[0][0]) == 101.0
    assert float(compiler.compile_spec(second)(*xs)[0][0]) == 110.0


def test_timings_account_for_every_phase(built):
    fast, _, args = built
    fast(*args)  # the first call of this signature in this process (tests may run in any order)
    report = fast.timings(*args)
    assert set(report["seconds"]) == {
        "trace",
        "analysis",
        "split",
        "lower",
        "compile",
        "relocate",
        "plan",
        "first_run",
    }
    assert all(s >= 0 for s in report["seconds"].values())
    assert report["seconds"]["first_run"] > 0 and report["seconds"]["compile"] > 0
    assert report["total_s"] == pytest.approx(sum(report["seconds"].values()))
    programs = {fast.compiler.program_key(spec) for spec in fast.plan_for(*args).cells.values()}
    assert report["compiled"] + report["relocated"] >= len({key[0] for key in programs})


def test_profile_counts_every_call_and_transfer(built):
    fast, _, args = built
    plan = fast.plan_for(*args)
    report = fast.profile(*args, rounds=2)
    assert sum(r.calls for r in report.rows) == sum(not is_transfer(fn) for fn, *_ in plan.steps)
    assert sum(r.transfers for r in report.rows) == sum(is_transfer(fn) for fn, *_ in plan.steps)
    assert {r.rank for r in report.rows} == set(range(fast.mesh.mpmd_dim))
    assert {r.kind for r in report.rows} >= {"setup"}
    assert report.cells == sum(len(cell.split("&")) for _, _, cell in plan.log if cell != "-")
    assert report.calls + report.copies == len(plan.hot_steps) and report.as_dict()["calls"] == report.calls
    assert report.copies == sum(is_transfer(fn) for fn, *_ in plan.hot_steps)
    assert report.issue_s > 0 and report.step_s > 0 and report.per_cell_us > 0
    assert "issue CPU per cell" in report.table()
    assert report.as_dict()["cells"] == report.cells


def test_profile_of_fused_cells_times_the_calls_the_step_issues(monkeypatch):
    """Where the step runs a rank's cells as one program, the rows still time each cell as its own
    call, and the summary's calls are the ones the step issues: on a clock that advances one unit
    per reading (each timed call costs one unit), the issued calls alone cost one unit each."""
    from spectrax_mpmd._runtime.clock import IssueClock

    hp = importlib.import_module("spectrax_mpmd._runtime.host_profile")  # the package names the function

    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:1])
    schedule = make_schedule("InterleavedH1", 4, v=LAYERS)  # one rank, a virtual stage per layer
    step = mp.sxvalue_and_grad(mlp_loss, mesh=mesh, schedule=schedule)
    params, batch = mlp_case()
    plan = step.plan_for(params, batch)
    assert 0 < len(plan.hot_steps) < len(plan.steps)  # the cells run fused
    readings = iter(range(10**9))
    monkeypatch.setattr(hp, "issue_clock", lambda: IssueClock(lambda: next(readings), "thread CPU", 1e-9))
    report = step.profile(params, batch, rounds=1)
    assert sum(r.calls + r.transfers for r in report.rows) == len(plan.steps)
    issued = len(plan.hot_steps)  # one rank: no copies
    assert (report.calls, report.copies) == (issued, 0) and report.calls_s == issued
    assert report.calls_per_cell_us == pytest.approx(issued * 1e6 / report.cells)
    assert report.per_call_us == pytest.approx(report.issue_s * 1e6 / issued)
    table = report.table()
    assert f"issued as {issued} call" in table and "and 0 copies" in table and "as its own call" in table


def test_profile_of_a_donating_call_consumes_none_of_the_arguments():
    """Each profiled run gets copies of the donated arguments: the caller's array survives, and a
    real call afterwards still consumes it and gives the right values."""
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])

    def f(x):
        return mp.sxstage_iter(x * 2) + 1

    jitted = mp.sxjit(f, mesh=mesh, donate_argnums=0)
    x = jax.device_put(jnp.ones(4), jax.devices()[0])
    profile = jitted.profile(x, rounds=2)
    assert profile.rows and not x.is_deleted()
    np.testing.assert_array_equal(jitted(x), np.full(4, 3.0))


def test_timings_before_any_call_is_a_clear_error():
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
    with pytest.raises(mp.MpmdError, match="nothing has been built"):
        mp.sxjit(lambda x: x, mesh=mesh).timings()


CACHED_RUN = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
import spectrax_mpmd as mp
from spectrax_core import schedules as S

def loss(params, x):
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean(x**2)

params = [jnp.eye(4) * (k + 1) / 4 for k in range(4)]
x = jnp.arange(16.0).reshape(4, 4) / 16
mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp")
step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.Std1F1B(microbatches=4))
value, grads = step(params, x)
print(json.dumps({"value": float(value), "grads": [g.tolist() for g in grads], **step.timings()}))
"""


def test_a_second_process_runs_from_the_persistent_cache(tmp_path):
    """With JAX's persistent cache on, a later process loads the programs from it and gets the
    same step (executables loaded from the cache are never relocated: their copies fail)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "cached_run.py"
    script.write_text(CACHED_RUN)
    cache = tmp_path / "cache"

    def run():
        out = subprocess.run(
            [sys.executable, str(script), str(cache)], capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert any(cache.iterdir())
    assert first["relocated"] == second["relocated"] == 0
    assert second["value"] == first["value"] and second["grads"] == first["grads"]


def test_arrays_already_where_the_plan_reads_them_are_used_as_they_are():
    """A committed array on the target sharding (a previous step's result) is passed as it is, as
    `jax.device_put` would return it; any other is placed."""
    from spectrax_mpmd._api.entry import Placer

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    target = NamedSharding(mesh, P("x"))
    placed = jax.device_put(jnp.arange(4.0), target)
    others = [jnp.arange(4.0), jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P())), np.arange(4.0)]
    out = Placer().place([placed, *others], [target] * 4, [None] * 4)
    assert out[0] is placed and jax.device_put(placed, target) is placed
    for got in out:
        assert got.sharding == target and got.committed
        np.testing.assert_array_equal(np.asarray(got), np.arange(4.0))


def test_ranks_with_equal_parameters_share_one_accumulator_program():
    """A loss rank's gradient accumulators start as every other rank's do, its loss accumulator
    from a constant zero that no cell donates: ranks whose parameters match run one setup program
    (compiled once), and the constant serves call after call."""
    make, args = mlp_steps("Std1F1B")
    step = make()
    first = step(*args)
    plan = step.plan_for(*args)
    setup = [
        spec
        for (_, ins, _, _), spec in zip(plan.hot_steps, plan.issued_specs)
        if spec is not None and not ins
    ]
    assert len(setup) == 4
    assert len({step.compiler.program_key(spec)[0] for spec in setup}) == 1
    losses = [s for s, _ in plan.accumulator_starts() if isinstance(plan.slot_names[s], LossAccumulator)]
    assert len(losses) == 1 and losses[0] in plan.const_slots
    second = step(*args)
    assert float(first[0]) == float(second[0])
    _bitwise_equal(first[1], second[1])
