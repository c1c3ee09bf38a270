"""The planner on meshes whose pipeline ranks own different numbers of devices: `advise` profiles each
rank's programs on its own submesh and predicts each rank's peak as a real step on that mesh holds
it, and its pick under a budget fits when run; `balance(devices=)`'s best split, built as a rank
mesh and run, holds the peaks it predicted; `balance` without `devices=` splits the layers on the
mesh's own ranks (the optimum of any cost table, peaks as run); profiles of ranks of different
shapes are cached apart."""

import jax
import numpy as np
import optax
import pytest
from test_mpmd_planner_devices import RULES, SCHEDULE, block_splits, cut, injected

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._planner.cache import profile_key
from spectrax_mpmd._planner.device_advice import balance_devices
from spectrax_mpmd._planner.devices import Split
from spectrax_mpmd.errors import MeshError, StageSplitError

TX = optax.adam(1e-3)


def _uneven_mesh(devices_per_rank):
    """Pipeline ranks of `devices_per_rank` devices each along `tp`, over the first devices."""
    axes = [{"fsdp": 1, "tp": k} for k in devices_per_rank]
    return mp.create_rank_mesh(axes, devices=jax.devices()[: sum(devices_per_rank)])


@pytest.fixture(scope="module")
def advised():
    """Advice for the 4-block model on ranks of 1, 1, 2 and 4 devices (its last, 3x block on 4)."""
    loss, args = cut((1,) * 4)
    mesh = _uneven_mesh((1, 1, 2, 4))
    advice = mp.advise(
        loss,
        *args,
        mesh=mesh,
        schedules=(S.Std1F1B, S.GPipe),
        microbatches=(8,),  # GPipe keeps all 8 alive on rank 0, Std1F1B 4
        virtual_stages=(1,),
        confirm=0,
        search=False,
        profile_cache=False,
        rounds=1,
        tx=TX,
        rules=RULES,
    )
    return advice, args


def measured_peaks(advice, candidate):
    params, *batch = advice.arguments(candidate)
    return advice.step(candidate=candidate).measure_peak_bytes(params, TX.init(params), *batch)


def test_advise_on_ranks_of_1_1_2_4_predicts_each_ranks_peak_as_run(advised):
    advice, args = advised
    for candidate in advice.candidates:
        measured = measured_peaks(advice, candidate)
        for p, m in zip(candidate.peak_bytes, measured):
            assert abs(p - m) <= 0.01 * m, (candidate.name, candidate.peak_bytes, measured)
    # the parameters (and Adam's two moments) are sharded over each rank's own devices: the last
    # block is 3x the others but its rank of 4 holds less of it per device than rank 0 holds
    params = [sum(w.w1.size + w.w2.size for w in args[0][r : r + 1]) * 4 for r in range(4)]
    assert params[3] == 3 * params[0]
    assert advice.best.peak_bytes[3] < advice.best.peak_bytes[0]


def test_advise_on_an_uneven_mesh_picks_under_a_budget_a_step_that_fits_when_run(advised):
    advice, _ = advised
    peaks = sorted(max(c.peak_bytes) for c in advice.candidates)
    assert peaks[0] < peaks[-1], advice.table()  # the budget below rules a candidate out
    budget = (peaks[0] + peaks[-1]) // 2
    under = advice.under(budget)
    assert max(under.best.peak_bytes) <= budget and len(under.fitting) < len(advice.candidates)
    assert max(measured_peaks(under, under.best)) <= budget


def test_balance_with_devices_on_an_uneven_mesh_predicts_the_peaks_of_its_split_as_run():
    widths = (128, 128, 384)
    result = mp.balance(
        lambda sizes: cut(sizes, widths),
        mesh=_uneven_mesh((1, 1, 2)),
        schedule=S.GPipe(microbatches=2),
        n_blocks=3,
        devices=4,
        device_sizes=(1, 2),
        cost_model="work",
        optimizer_states=0,  # the plain step run below holds no optimizer state
        rounds=1,
        rules=RULES,
    )
    assert isinstance(result, mp.DeviceBalance) and sum(result.devices) <= 4
    loss, args = cut(result.sizes, widths)
    step = mp.sxvalue_and_grad(
        loss, mesh=_uneven_mesh(result.devices), schedule=S.GPipe(microbatches=2), rules=RULES
    )
    measured = step.measure_peak_bytes(*args)
    for p, m in zip(result.best.peak_bytes, measured):
        assert abs(p - m) <= 0.01 * m, (result.table(), measured)


def test_profiles_of_ranks_of_different_shapes_are_cached_apart():
    settings = (repr(SCHEDULE), (), 1)

    def key(sizes):
        return profile_key("program", "update", settings, _uneven_mesh(sizes))

    assert key((1, 1, 2, 4)) == key((1, 1, 2, 4))
    assert len({key((1, 1, 2, 4)), key((4, 2, 1, 1)), key((1, 2, 1, 4)), key((2, 2, 2, 2))}) == 4


@pytest.mark.parametrize("seed", range(8))
def test_on_given_ranks_the_layer_split_is_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    ranks = tuple(int(k) for k in rng.choice((1, 2, 4), size=int(rng.integers(2, 4))))
    seconds = tuple(rng.uniform(0.5, 3.0, int(rng.integers(len(ranks), 7))))
    costs = injected(float(rng.uniform(0.8, 2.0)), seconds=seconds)
    result = balance_devices(costs, SCHEDULE, len(ranks), sum(ranks), ranks=ranks)
    table = costs.seconds("measured")

    def slowest(blocks):
        bounds = Split(blocks, ranks).bounds()
        return max(sum(table[k][i:j]) for (i, j), k in zip(bounds, ranks))

    assert {c.label for c in result.candidates} == {"chosen", "even"}
    assert result.devices == ranks and result.plan("even").split.devices == ranks
    best = min(slowest(b) for b in block_splits(len(seconds), len(ranks)))
    assert slowest(result.plan("chosen").split.blocks) == pytest.approx(best, rel=1e-12)


def test_balance_on_ranks_of_1_1_2_splits_the_layers_on_them_and_predicts_their_peaks_as_run():
    widths, schedule = (128, 128, 128, 384), S.GPipe(microbatches=2)
    mesh = _uneven_mesh((1, 1, 2))
    result = mp.balance(
        lambda sizes: cut(sizes, widths),
        mesh=mesh,
        schedule=schedule,
        n_blocks=4,
        cost_model="work",
        optimizer_states=0,
        rounds=1,
        rules=RULES,
    )
    assert isinstance(result, mp.DeviceBalance) and result.devices == (1, 1, 2) and sum(result.sizes) == 4
    assert result.best.step_s <= result.plan("even").step_s, result.table()
    loss, args = cut(result.sizes, widths)
    measured = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule, rules=RULES).measure_peak_bytes(*args)
    # exact for a stage of one block (a stage of several sums what each keeps alone: `split_memory`)
    single = [r for r, b in enumerate(result.sizes) if b == 1]
    assert single, result.table()
    for r in single:
        assert abs(result.best.peak_bytes[r] - measured[r]) <= 0.01 * measured[r], (result.table(), measured)


def test_balance_on_uneven_ranks_refuses_what_it_cannot_predict_before_profiling():
    calls = []

    def fn(sizes):
        calls.append(sizes)
        return cut(sizes)

    with pytest.raises(StageSplitError, match="one stage per rank"):
        mp.balance(
            fn,
            mesh=_uneven_mesh((2, 6)),
            schedule=S.InterleavedH1(microbatches=4, virtual_stages=2),
            n_blocks=4,
        )
    same_size = mp.create_rank_mesh([{"tp": 2}, {"fsdp": 2}], devices=jax.devices()[:4])
    with pytest.raises(MeshError, match="ranks of 2 devices have different shapes"):
        mp.balance(fn, mesh=same_size, schedule=SCHEDULE, n_blocks=4)
    assert len(calls) == 2  # called for the arguments; nothing profiled
