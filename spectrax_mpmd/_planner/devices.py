"""How many devices each pipeline stage gets, chosen with the layer split.

Some stages cannot be balanced by moving layers (a head with a large vocabulary,
a last stage carrying the loss): they can only be given more devices. From each
block's cost and bytes measured on a rank of k devices
(`spectrax_mpmd._planner.block_costs`), dynamic programming over (blocks, devices)
chooses the contiguous block split and the devices of each stage whose slowest
stage is fastest, under a total device count and a memory budget per device
(`split_devices`). The choice, the even split and the layer-only balance are then
simulated with the schedule (per rank its own cells and bytes) and ranked by
predicted step (`DeviceBalance`), which also says why: the heaviest stage's cost
on each device count, as measured and as the cost model counts it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from spectrax_core import schedules as S
from spectrax_core.schedules import StageCost, StageMemory

from ..errors import StageSplitError
from .block_costs import BlockCosts


@dataclass(frozen=True)
class Split:
    """Blocks per stage (contiguous, in order) and devices per stage."""

    blocks: tuple[int, ...]
    devices: tuple[int, ...]

    def bounds(self) -> list[tuple[int, int]]:
        """Each stage's `(first block, one past its last)`."""
        ends = np.cumsum((0, *self.blocks)).tolist()
        return list(zip(ends, ends[1:]))


def split_devices(
    block_s: Mapping[int, Sequence[float]],
    n_stages: int,
    total: int,
    *,
    fits: Callable[[int, int, int, int], bool] | None = None,
) -> Split:
    """The split whose slowest stage is fastest: contiguous blocks, at least one per stage, and a
    device count per stage among `block_s`'s keys (`block_s[k][b]`: block b's seconds on a rank
    of k devices; a stage costs the sum of its blocks'), the counts adding up to at most
    `total`. `fits(k, i, j, s)` says whether blocks `i:j` on k devices fit as stage s (default:
    always). Ties go to the fewest devices, then the earliest cut."""
    sizes = sorted(block_s)
    n_blocks = len(block_s[sizes[0]])
    if n_blocks < n_stages or n_stages * sizes[0] > total:
        raise StageSplitError(
            f"split_devices: {n_blocks} blocks on {total} devices cannot make {n_stages} stages of at least "
            f"one block and {sizes[0]} device(s) each; use fewer stages or more devices."
        )
    prefix = {k: np.concatenate([[0.0], np.cumsum(block_s[k])]) for k in sizes}
    fits = fits or (lambda k, i, j, s: True)
    inf = float("inf")
    best = np.full((n_stages + 1, n_blocks + 1, total + 1), inf)
    best[0, 0, 0] = 0.0
    choice: dict = {}
    for s in range(1, n_stages + 1):
        for j, d in itertools.product(range(s, n_blocks + 1), range(total + 1)):
            for i, k in itertools.product(range(s - 1, j), sizes):
                if k > d or best[s - 1, i, d - k] == inf or not fits(k, i, j, s - 1):
                    continue
                value = max(best[s - 1, i, d - k], prefix[k][j] - prefix[k][i])
                if value < best[s, j, d]:
                    best[s, j, d], choice[s, j, d] = value, (i, k)
    d = int(np.argmin(best[n_stages, n_blocks]))  # the fewest devices among the fastest
    if best[n_stages, n_blocks, d] == inf:
        raise StageSplitError(
            f"split_devices: no split of {n_blocks} blocks into {n_stages} stages on at most {total} devices "
            "fits the memory budget; raise memory_budget, allow larger device_sizes, or use remat=True."
        )
    blocks, devices, j = [], [], n_blocks
    for s in range(n_stages, 0, -1):
        i, k = choice[s, j, d]
        blocks.append(j - i)
        devices.append(k)
        j, d = i, d - k
    return Split(tuple(reversed(blocks)), tuple(reversed(devices)))


def split_cost(costs: BlockCosts, split: Split, cost_model: str) -> StageCost:
    """Per stage, its blocks' forward and backward seconds on its device count (a backward that
    is not split: `I` and `W` zero)."""
    forward, backward = costs.cells(cost_model)
    rows = {"F": [], "B": []}
    for (i, j), k in zip(split.bounds(), split.devices):
        rows["F"].append(float(sum(forward[k][i:j])))
        rows["B"].append(float(sum(backward[k][i:j])))
    zeros = (0.0,) * len(split.devices)
    return StageCost(tuple(rows["F"]), tuple(rows["B"]), zeros, zeros)


def split_memory(costs: BlockCosts, split: Split, optimizer_states: float = 0.0) -> StageMemory:
    """Per stage (rank r holds stage r) the bytes on one device of its rank: what its first block
    receives and sends back per microbatch, what all its blocks keep per microbatch, its
    parameters, their accumulators, `optimizer_states` copies of the parameters (the
    optimizer's state) and the other arguments its cells read, each on its device count
    (`BlockCosts`). Exact for one block per stage; a stage of several blocks sums what they
    keep as each kept it alone (what they pass each other is not added; a leaf two of them
    read counts twice)."""
    rows: dict = {name: [] for name in ("inputs", "kept_inputs", "residuals", "grads", "stash")}
    static: dict = {name: [] for name in ("params", "accumulators", "other")}
    for (i, j), k in zip(split.bounds(), split.devices):
        for name in rows:
            values = getattr(costs.memory[k], name)
            rows[name].append(int(values[i] if name in ("inputs", "grads") else sum(values[i:j])))
        for name, per_block in static.items():
            per_block.append(int(sum(getattr(costs, name)[k][i:j])))
    return StageMemory(
        **{name: tuple(v) for name, v in (rows | static).items()},
        optimizer=tuple(round(optimizer_states * p) for p in static["params"]),
    )


def even_devices(sizes: Sequence[int], n_stages: int, total: int) -> tuple[int, ...]:
    """Every stage the same count: the most of `sizes` that `n_stages` of fit in `total`."""
    fitting = [k for k in sizes if k * n_stages <= total]
    return (max(fitting or [min(sizes)]),) * n_stages


def fitting(costs: BlockCosts, schedule, n: int, budget, optimizer_states: float) -> Callable | None:
    """`fits(k, i, j, s)` for `split_devices`: blocks `i:j` on k devices, as stage s, hold their
    parameters, accumulators and optimizer state plus what they keep per microbatch times the
    microbatches the schedule keeps alive on rank s at its peak, within `budget`."""
    if budget is None:
        return None
    alive = S.simulate(schedule, n).peak_activations

    def fits(k: int, i: int, j: int, s: int) -> bool:
        memory = costs.memory[k]
        held = sum(memory.kept_inputs[i:j]) + sum(memory.residuals[i:j]) + sum(memory.stash[i:j])
        static = (1 + optimizer_states) * sum(costs.params[k][i:j]) + sum(costs.accumulators[k][i:j])
        static += sum(costs.other[k][i:j])
        return static + alive[s] * (held + memory.inputs[i] + memory.grads[i]) <= budget

    return fits
