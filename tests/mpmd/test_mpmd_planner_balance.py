"""`stage_sizes="auto"`: contiguous block boundaries chosen by dynamic programming over profiled
per-block costs; on blocks of very different widths and a heavy head, the measured slowest stage
drops against the even split by about the margin the profile predicts."""

import itertools

import jax
import numpy as np
import pytest
from planner_cases import residual_lm_loss, residual_mlp_lm

import spectrax_mpmd as mp
from spectrax_core import schedules as S

WIDTHS = (64, 64, 512, 512, 64, 64, 64, 64)  # an even 4-way split puts both wide blocks on stage 1
D, VOCAB, BATCH, LENGTH, M = 64, 320, 32, 32, 4  # the head (vocabulary 320) costs about a wide block
MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
SCHEDULE = S.Std1F1B(microbatches=M)


def init():
    return residual_mlp_lm(WIDTHS, d=D, vocab=VOCAB, batch=BATCH, length=LENGTH, scale=8)


def cut(sizes):
    """The model's loss cut after each of `sizes`' stages, and its parameters and batch."""
    return residual_lm_loss(sizes), init()


def measured_slowest(splits, repeats: int = 3) -> list[float]:
    """Per split, its slowest stage's measured seconds per microbatch (forward plus backward cells):
    the splits are timed in turn, `repeats` times, so they share the machine's load, and each
    stage keeps its least time."""
    steps = []
    for sizes in splits:
        loss, args = cut(sizes)
        steps.append((mp.sxvalue_and_grad(loss, mesh=MESH, schedule=SCHEDULE), args))
    best = [[float("inf")] * 4 for _ in splits]
    for _ in range(repeats):
        for k, (step, args) in enumerate(steps):
            cost = step.profile_stages(*args, rounds=3).stage_cost()
            best[k] = [min(t, f + b) for t, f, b in zip(best[k], cost.F, cost.B)]
    return [max(stages) for stages in best]


@pytest.mark.timing
def test_auto_lowers_the_slowest_stage_by_the_predicted_margin():
    balance = mp.balance(cut, mesh=MESH, schedule=SCHEDULE, n_blocks=len(WIDTHS), rounds=7)
    assert sum(balance.sizes) == len(WIDTHS) and min(balance.sizes) >= 1 and len(balance.sizes) == 4
    assert balance.even_sizes == (2, 2, 2, 2) and balance.sizes != balance.even_sizes
    assert balance.predicted_speedup > 1.3
    even, auto = measured_slowest([balance.even_sizes, balance.sizes])
    measured = even / auto
    # Cell times are the least over timed rounds, and both splits are timed in turn; still, on a
    # shared machine single cells vary by a third, so the margin is checked as a ratio of
    # ratios with that much room, never as raw times.
    assert measured > 1.25, (even, auto, balance.table())
    assert 1 / 1.5 <= measured / balance.predicted_speedup <= 1.5, (measured, balance.table())
    assert "auto" in balance.table() and "even" in balance.table()


COSTS = [1.0, 1.0, 7.0, 7.0, 1.0, 1.0, 1.0, 8.0]  # the last block carries the head


def splits(n_blocks, n_stages):
    """Every split of `n_blocks` into `n_stages` contiguous non-empty groups."""
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *cuts, n_blocks)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def slowest(sizes, costs=COSTS, overhead=0.0):
    bounds = np.cumsum((0, *sizes))
    return max(sum(costs[a:b]) - (b - a - 1) * overhead for a, b in zip(bounds, bounds[1:]))


def test_split_blocks_minimises_the_slowest_stage_and_keeps_every_block():
    for n in range(1, 9):
        sizes = mp.split_blocks(COSTS, n)
        assert len(sizes) == n and sum(sizes) == 8 and min(sizes) >= 1
        assert slowest(sizes) == min(slowest(s) for s in splits(8, n))
    assert mp.split_blocks(COSTS, 8) == (1,) * 8
    # a fixed cost per cell, paid once per stage, makes merged blocks cheaper than their sum
    sizes = mp.split_blocks(COSTS, 3, overhead_s=0.5)
    assert slowest(sizes, overhead=0.5) == min(slowest(s, overhead=0.5) for s in splits(8, 3))


def test_split_blocks_respects_a_memory_budget():
    block_bytes = [(100, 10)] * 8  # (static, per microbatch) bytes of each block
    activations = [4, 3, 2, 1]  # microbatches live on each stage's rank at its peak (1F1B)

    def fits(sizes, budget):
        bounds = np.cumsum((0, *sizes))
        return all(
            (b - a) * (100 + activations[k] * 10) <= budget
            for k, (a, b) in enumerate(zip(bounds, bounds[1:]))
        )

    for budget in (300, 420, 1000):
        sizes = mp.split_blocks(COSTS, 4, block_bytes=block_bytes, activations=activations, budget=budget)
        assert fits(sizes, budget)
        assert slowest(sizes) == min(slowest(s) for s in splits(8, 4) if fits(s, budget))
    with pytest.raises(mp.StageSplitError, match="memory budget"):
        mp.split_blocks(COSTS, 4, block_bytes=block_bytes, activations=activations, budget=100)


def test_fewer_blocks_than_stages_says_so():
    with pytest.raises(mp.StageSplitError, match="3 blocks but the mesh and schedule need 4 stages"):
        mp.split_blocks([1.0, 2.0, 3.0], 4)
    with pytest.raises(mp.StageSplitError, match="3 blocks"):
        mp.balance(cut, mesh=MESH, schedule=SCHEDULE, n_blocks=3)
