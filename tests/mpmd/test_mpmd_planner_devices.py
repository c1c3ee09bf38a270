"""Devices per stage: the search finds the brute-force optimum of any cost table; a stage's bytes on a
rank of k devices, predicted from the per-block profile, equal a real step's peak on ranks of k
devices; a model whose last stage is 3x the others gets that stage more devices, ranked above the
even split."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core import sharding as sh
from spectrax_core.schedules import StageMemory
from spectrax_mpmd._planner.block_costs import BlockCosts, profile_blocks
from spectrax_mpmd._planner.device_advice import balance_devices
from spectrax_mpmd._planner.devices import Split, split_devices, split_memory
from spectrax_mpmd.errors import MeshError, StageSplitError


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    """A residual MLP block whose hidden axis the rules shard over `tp`."""

    w1: jax.Array
    w2: jax.Array

    def logical_axes(self):
        return {"w1": ("EMBED", "MLP"), "w2": ("MLP", "EMBED")}


D, BATCH, M = 64, 64, 4
WIDTHS = (512, 512, 512, 1536)  # the last block does 3x the others' work
RULES = sh.Rules.default()
SCHEDULE = S.Std1F1B(microbatches=M)
MESH = mp.create_mesh((4, 1, 1, 1, 2, 1), mpmd_axis="pp")  # 4 ranks over the 8 devices


def init(widths=WIDTHS):
    keys = jax.random.split(jax.random.key(0), 2 * len(widths) + 2)
    blocks = [
        Block(jax.random.normal(keys[2 * i], (D, h)) / 8, jax.random.normal(keys[2 * i + 1], (h, D)) / 8)
        for i, h in enumerate(widths)
    ]
    return blocks, jax.random.normal(keys[-1], (BATCH, D)), jax.random.normal(keys[-2], (BATCH, D))


def cut(sizes, widths=WIDTHS):
    """The loss with a stage marker after each of `sizes`' stages (block counts), and its arguments."""
    ends = set(np.cumsum(sizes)[:-1].tolist())

    def loss(blocks, x, y):
        for i, block in enumerate(blocks):
            x = x + jnp.tanh(x @ block.w1) @ block.w2
            if i + 1 in ends:
                x = mp.sxstage_iter(x)
        return jnp.mean((x - y) ** 2)

    return loss, init(widths)


# --- the search against brute force ------------------------------------------------------------


def block_splits(n_blocks, n_stages):
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *cuts, n_blocks)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def brute_force(table, n_stages, total, fits):
    """The least slowest stage over every block split and every device count per stage."""
    best = float("inf")
    for blocks in block_splits(len(table[1]), n_stages):
        bounds = Split(blocks, (1,) * n_stages).bounds()
        for devices in itertools.product(sorted(table), repeat=n_stages):
            if sum(devices) > total:
                continue
            if not all(fits(k, i, j, s) for s, ((i, j), k) in enumerate(zip(bounds, devices))):
                continue
            best = min(best, max(sum(table[k][i:j]) for (i, j), k in zip(bounds, devices)))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_search_finds_the_brute_force_optimum_of_a_cost_table(seed):
    rng = np.random.default_rng(seed)
    n_blocks, n_stages = int(rng.integers(3, 7)), int(rng.integers(2, 4))
    n_stages = min(n_stages, n_blocks)
    total = int(rng.integers(n_stages, 4 * n_stages + 1))
    base = rng.uniform(0.5, 3.0, n_blocks)
    # more devices help some blocks, hurt others (measured on shared cores), by a random factor each
    table = {k: tuple(base * rng.uniform(0.3, 1.3, n_blocks) ** np.log2(k)) for k in (1, 2, 4)}
    held = rng.uniform(1.0, 4.0, n_blocks)
    budget = float(rng.uniform(2.0, 8.0)) if seed % 2 else None

    def fits(k, i, j, s):
        return budget is None or held[i:j].sum() / k <= budget

    expected = brute_force(table, n_stages, total, fits)
    if expected == float("inf"):
        with pytest.raises(StageSplitError, match="fits the memory budget"):
            split_devices(table, n_stages, total, fits=fits)
        return
    found = split_devices(table, n_stages, total, fits=fits)
    bounds = found.bounds()
    assert sum(found.blocks) == n_blocks and min(found.blocks) >= 1 and sum(found.devices) <= total
    assert all(fits(k, i, j, s) for s, ((i, j), k) in enumerate(zip(bounds, found.devices)))
    slowest = max(sum(table[k][i:j]) for (i, j), k in zip(bounds, found.devices))
    assert slowest == pytest.approx(expected, rel=1e-12), (found, expected)


def test_too_few_devices_or_blocks_say_so():
    table = {1: (1.0, 1.0), 2: (0.5, 0.5)}
    with pytest.raises(StageSplitError, match="cannot make 3 stages"):
        split_devices(table, 3, 8)
    with pytest.raises(StageSplitError, match="cannot make 2 stages"):
        split_devices(table, 2, 1)


# --- an injected cost table -------------------------------------------------------------------


def injected(speedup: float, sizes=(1, 2, 4), seconds=(1.0, 1.0, 1.0, 3.0), held=0) -> BlockCosts:
    """Blocks of `seconds` on one device, `speedup` times faster per doubling of devices, with
    `held` bytes kept per microbatch (halved per doubling) and nothing else."""
    n = len(seconds)
    zeros = (0,) * n

    def memory(k):
        return StageMemory(zeros, zeros, (held // k,) * n, zeros, zeros, (0,), (0,), (0,), (0,))

    def scaled(k):
        return tuple(t / speedup ** np.log2(k) / 2 for t in seconds)

    return BlockCosts(
        tuple(sizes),
        {k: scaled(k) for k in sizes},
        {k: scaled(k) for k in sizes},
        {k: tuple(1.0 / k for _ in seconds) for k in sizes},
        {k: zeros for k in sizes},
        {k: zeros for k in sizes},
        {k: zeros for k in sizes},
        {k: memory(k) for k in sizes},
    )


def test_with_a_backend_where_devices_help_the_heavy_stage_gets_them_and_ranks_first():
    result = balance_devices(injected(speedup=2.0), SCHEDULE, 4, 8)
    assert result.devices[-1] == max(result.devices) > min(result.devices), result.table()
    assert result.best.label == "chosen" and result.best.step_s < result.plan("even").step_s
    assert result.devices == (1, 1, 1, 4), result.table()  # slowest stage 1.0 (3 / 4 last) beats even 1.5


def test_with_a_backend_where_devices_do_not_help_none_are_spent():
    result = balance_devices(injected(speedup=0.9), SCHEDULE, 4, 8)
    assert result.devices == (1, 1, 1, 1), result.table()
    assert result.best.step_s < result.plan("even").step_s


def test_a_memory_budget_buys_devices_that_do_not_help_speed():
    held = 1 << 20
    free = balance_devices(injected(speedup=0.9, held=held), SCHEDULE, 4, 8)
    alive = max(S.simulate(SCHEDULE, 4).peak_activations)
    tight = balance_devices(injected(speedup=0.9, held=held), SCHEDULE, 4, 8, memory_budget=alive * held // 2)
    assert free.devices == (1, 1, 1, 1) and max(free.best.peak_bytes) > alive * held // 2
    # 1F1B keeps 4, 3, 2, 1 microbatches alive on ranks 0..3: each gets the fewest devices that
    # hold them within 2 microbatches' bytes, and no more (more devices are slower here)
    assert tight.best.fits and tight.devices == (2, 2, 1, 1), tight.table()


# --- profiled on the fake devices -------------------------------------------------------------


@pytest.fixture(scope="module")
def costs():
    loss, args = cut((1,) * len(WIDTHS))
    on = {"sizes": (1, 2, 4), "axis": "tp"}
    return profile_blocks(
        loss, args, mp.StepSettings("balance", mesh=MESH, schedule=SCHEDULE, rules=RULES), len(WIDTHS), on, 3
    )


def test_by_per_device_work_the_3x_last_stage_gets_more_devices_and_ranks_above_even(costs):
    result = balance_devices(costs, SCHEDULE, 4, 8, cost_model="work")
    assert result.devices[-1] > max(result.devices[:-1]), result.table()
    assert result.best.label == "chosen" and result.best.step_s < result.plan("even").step_s, result.table()
    assert result.heavy_stage == 3 and "work" in result.why()
    measured, costed = zip(*(result.heavy_s[k] for k in (1, 2, 4)))
    assert costed[0] > 1.6 * costed[1] > 1.6**2 * costed[2]  # per-device work halves with the devices
    assert measured == tuple(sum(costs.seconds("measured")[k][3:4]) for k in (1, 2, 4))
    assert costs.seconds("work")[1] == pytest.approx(costs.seconds("measured")[1], rel=1e-12)


def test_by_measured_seconds_the_choice_is_the_optimum_of_what_was_measured(costs):
    result = balance_devices(costs, SCHEDULE, 4, 8, cost_model="measured")
    table = costs.seconds("measured")
    assert result.plan("chosen").split == split_devices(table, 4, 8)
    assert "measured" in result.why() and "on 4 device(s)" in result.why()
    chosen = result.plan("chosen").split
    slowest = max(sum(table[k][i:j]) for (i, j), k in zip(chosen.bounds(), chosen.devices))
    even = max(sum(table[2][i:j]) for i, j in result.plan("even").split.bounds())
    assert slowest <= even


def test_per_device_bytes_shrink_with_the_devices_a_block_is_sharded_over(costs):
    for k in (2, 4):
        assert costs.params[k] == tuple(p // k for p in costs.params[1])
        assert costs.flops[k][3] < costs.flops[1][3] / (k / 1.2)


@pytest.mark.parametrize("k", (1, 2, 4))
def test_predicted_peak_per_rank_on_k_devices_equals_a_real_steps(k):
    loss, args = cut((1, 1), WIDTHS[-2:])
    one_rank = mp.create_mesh((1, 1, 1, 1, 4, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    settings = mp.StepSettings("balance", mesh=one_rank, schedule=SCHEDULE, rules=RULES)
    profiled = profile_blocks(loss, args, settings, 2, {"sizes": (k,), "axis": "tp"}, 1)
    memory = split_memory(profiled, Split((1, 1), (k, k)))
    predicted = S.simulate(SCHEDULE, 2, memory=memory).peak_bytes
    mesh = mp.create_mesh((2, 1, 1, 1, k, 1), mpmd_axis="pp", devices=jax.devices()[: 2 * k])
    measured = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=SCHEDULE, rules=RULES).measure_peak_bytes(*args)
    for p, m in zip(predicted, measured):
        assert abs(p - m) <= 0.01 * m, (k, predicted, measured)
    # the activations are a real share of rank 0's peak, so the check is not about parameters alone
    assert measured[0] - memory.static(0) > 0.1 * measured[0]
    assert memory.params == tuple(WIDTHS[-2 + r] * D * 2 * 4 // k for r in range(2))  # sharded k ways


# --- through balance ----------------------------------------------------------------------------


def test_balance_with_devices_ranks_the_splits_and_says_why():
    widths = (128, 128, 384)
    mesh = mp.create_mesh((3, 1, 1, 1, 2, 1), mpmd_axis="pp", devices=jax.devices()[:6])
    result = mp.balance(
        lambda sizes: cut(sizes, widths),
        mesh=mesh,
        schedule=S.GPipe(microbatches=2),
        n_blocks=3,
        devices=6,
        device_sizes=(2, 1),
        cost_model="work",
        rounds=3,
        rules=RULES,
    )
    assert sum(result.devices) <= 6 and len(result.sizes) == 3 and sum(result.sizes) == 3
    assert {c.label for c in result.candidates} == {"chosen", "even", "layers only"}
    # which stage measures heaviest depends on the machine (at these sizes a cell's fixed cost can
    # outweigh the 3x block); the injected-cost tests above pin the choice, this one the wiring
    stage = result.heavy_stage
    assert result.heavy_blocks == (stage, stage + 1)  # the even split has one block per stage
    assert sorted(result.heavy_s) == [1, 2] and f"stage {stage} (blocks {stage}:{stage + 1})" in result.why()
    assert "chosen" in result.table()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"cost_model": "flops"}, ValueError, "cost_model must be one of"),
        ({"device_sizes": (0, 2)}, StageSplitError, "device_sizes must be device counts"),
        ({"device_sizes": (16,)}, StageSplitError, "device_sizes must be device counts"),
        ({"devices": 0}, StageSplitError, "devices must be a positive int"),
        ({"schedule": S.ZeroBubbleH1(microbatches=4)}, StageSplitError, "unsplit backward"),
        ({"device_axis": "pp"}, MeshError, "device_axis must be one of"),
    ],
)
def test_bad_device_arguments_are_refused_before_any_profile(kwargs, error, match):
    calls = []

    def fn(sizes):
        calls.append(sizes)
        return cut(sizes)

    settings = {"schedule": SCHEDULE, "devices": 8, **kwargs}
    with pytest.raises(error, match=match):
        mp.balance(fn, mesh=MESH, n_blocks=4, **settings)
    assert len(calls) <= 1  # the function is called for its arguments, nothing is profiled


def _uneven_mesh(devices_per_rank, axis="tp"):
    """Pipeline ranks of `devices_per_rank` devices each, along `axis`."""
    names = tuple(n for n in MESH.axis_names if n != "pp")
    return mp.create_rank_mesh([{n: k if n == axis else 1 for n in names} for k in devices_per_rank])


def test_predicted_peaks_on_ranks_of_1_1_2_4_devices_equal_a_real_steps(costs):
    loss, args = cut((1,) * len(WIDTHS))
    split = Split((1, 1, 1, 1), (1, 1, 2, 4))
    predicted = S.simulate(SCHEDULE, 4, memory=split_memory(costs, split)).peak_bytes
    step = mp.sxvalue_and_grad(loss, mesh=_uneven_mesh(split.devices), schedule=SCHEDULE, rules=RULES)
    measured = step.measure_peak_bytes(*args)
    for p, m in zip(predicted, measured):
        assert abs(p - m) <= 0.01 * m, (predicted, measured)


# --- through advise -----------------------------------------------------------------------------


def test_advise_with_devices_ranks_the_splits_of_its_own_profile():
    loss, args = cut((1,) * len(WIDTHS))
    common = {"mesh": MESH, "schedules": (S.Std1F1B,), "microbatches": (M,), "virtual_stages": (1,)}
    advice = mp.advise(
        loss,
        *args,
        **common,
        confirm=0,
        search=False,
        profile_cache=False,
        devices=8,
        cost_model="work",
        rules=RULES,
        rounds=4,  # each cell's least of 4: a load burst on shared cores cannot make a light block heavy
    )
    # which split wins rests on the cells this machine measures (the injected-cost tests above pin
    # that a heavy stage gets the devices); here: the ranking and the wiring
    split = advice.devices
    assert sum(split.devices) <= 8 and split.best is split.candidates[0], split.table()
    assert split.best.step_s == min(c.step_s for c in split.candidates), split.table()
    assert advice.under(None).devices is split
    with pytest.raises(MeshError, match="device_axis must be one of"):
        mp.advise(loss, *args, **common, devices=8, device_axis="model")
