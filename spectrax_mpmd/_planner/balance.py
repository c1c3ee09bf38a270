"""Automatic stage balancing: contiguous block boundaries that minimise the slowest stage.

A model made of blocks (what runs before them lands on the first stage, what
runs after them, the head and loss, on the last) is profiled once cut at every
block, all on one rank, so each block's forward and backward time (and bytes)
is measured from its own compiled cells — the first block's with the
embedding, the last block's with the head and loss. Dynamic programming over
those per-block costs then chooses the split whose slowest stage is fastest,
optionally under a memory budget per device.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
import optax

from spectrax_core import schedules as S

from .._api import step_function
from .._compile.compiler import Compiler
from .._mesh import MpmdMesh, as_mpmd_mesh
from .._settings import StepSettings
from .._stages import stage_sizes
from .._trace.context import outside_context_mesh
from ..errors import StageSplitError
from .block_costs import fixed_cell_seconds, per_block_schedule
from .device_advice import DeviceBalance, balance_on_devices, balance_on_ranks
from .optimizer import ASSUMED_STATES

log = logging.getLogger("spectrax_mpmd")


@dataclass(frozen=True)
class Balance:
    """A split of `len(block_s)` blocks into stages, with the profile's prediction for it.

    `sizes` blocks per stage and `stage_s` each stage's predicted seconds per
    microbatch (forward plus backward); `even_sizes` / `even_stage_s` the same
    for the even split; `block_s` the profiled seconds of each block (the first
    with what precedes the blocks, the last with the head and loss);
    `overhead_s` the fixed cost of one stage's forward and backward cells, which
    a stage of several blocks pays once. `optimizer` says how the optimizer's
    state was counted against a memory budget.
    """

    sizes: tuple[int, ...]
    stage_s: tuple[float, ...]
    even_sizes: tuple[int, ...]
    even_stage_s: tuple[float, ...]
    block_s: tuple[float, ...]
    overhead_s: float
    optimizer: str = ""

    @property
    def predicted_speedup(self) -> float:
        """The even split's slowest stage over this split's."""
        return max(self.even_stage_s) / max(self.stage_s)

    def table(self) -> str:
        def row(name, sizes, times):
            ms = " ".join(f"{t * 1e3:.3f}" for t in times)
            return f"{name:6} blocks {sizes}  ms per stage [{ms}]  slowest {max(times) * 1e3:.3f}"

        return "\n".join(
            [
                row("auto", self.sizes, self.stage_s),
                row("even", self.even_sizes, self.even_stage_s),
                f"predicted: the slowest stage {self.predicted_speedup:.2f}x faster than the even split's",
                *([f"optimizer: {self.optimizer}"] if self.optimizer else []),
            ]
        )


def split_blocks(
    block_s: Sequence[float],
    n_stages: int,
    *,
    overhead_s: float = 0.0,
    block_bytes: Sequence[tuple[int, int]] | None = None,
    activations: Sequence[int] | None = None,
    budget: int | None = None,
) -> tuple[int, ...]:
    """Blocks per stage: contiguous, at least one each, minimising the slowest stage's time, the
    sum of its blocks' `block_s` less `overhead_s` for each block after the first (the fixed
    cost of a cell, which a stage pays once however many blocks it runs).

    With `budget`, stage k's bytes — the sum of its blocks' `(static, per microbatch)` bytes
    as `static + activations[k] * per microbatch` — must not exceed it.
    """
    n_blocks = len(block_s)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise StageSplitError(f"split_blocks: n_stages must be a positive int, received {n_stages!r}.")
    if budget is not None and (
        block_bytes is None
        or activations is None
        or len(block_bytes) != n_blocks
        or len(activations) != n_stages
    ):
        raise StageSplitError(
            "split_blocks: a budget needs block_bytes (one (static, per microbatch) pair per block) and "
            "activations (one count per stage)."
        )
    if n_blocks < n_stages:
        raise StageSplitError(
            f"the model has {n_blocks} blocks but the mesh and schedule need {n_stages} stages, so no "
            "split gives every stage a block; use fewer pipeline ranks or virtual stages, or a deeper model."
        )
    prefix = np.concatenate([[0.0], np.cumsum([t - overhead_s for t in block_s])])
    static = np.concatenate([[0], np.cumsum([b[0] for b in block_bytes])]) if block_bytes else None
    held = np.concatenate([[0], np.cumsum([b[1] for b in block_bytes])]) if block_bytes else None

    def fits(k: int, i: int, j: int) -> bool:
        if budget is None:
            return True
        return static[j] - static[i] + activations[k] * (held[j] - held[i]) <= budget

    inf = float("inf")
    best = [[inf] * (n_blocks + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_blocks + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n_blocks - (n_stages - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] < inf and fits(k - 1, i, j):
                    value = max(best[k - 1][i], prefix[j] - prefix[i] + overhead_s)
                    if value < best[k][j]:
                        best[k][j], cut[k][j] = value, i
    if best[n_stages][n_blocks] == inf:
        bounds = [0, *np.cumsum(stage_sizes(n_blocks, n_stages)).tolist()]
        even = max(
            static[j] - static[i] + activations[k] * (held[j] - held[i])
            for k, (i, j) in enumerate(zip(bounds, bounds[1:]))
        )
        raise StageSplitError(
            f"no split of {n_blocks} blocks into {n_stages} stages fits the memory budget of {budget:.0f} "
            f"bytes per stage (the even split's fullest stage needs {int(even)}); raise memory_budget, "
            "use remat=True, or more pipeline ranks."
        )
    sizes, j = [], n_blocks
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def one_rank_mesh(mesh: MpmdMesh) -> MpmdMesh:
    """`mesh` reduced to its first pipeline rank: where the per-block profile runs."""
    pos = mesh.axis_names.index(mesh.mpmd_axis)
    return as_mpmd_mesh(
        jax.sharding.Mesh(np.take(mesh.devices, [0], axis=pos), mesh.axis_names), mesh.mpmd_axis
    )


def balance_from_profile(
    profile,
    schedule,
    n: int,
    *,
    memory_budget: int | None = None,
    optimizer_states: float = 0.0,
    optimizer: str = "",
) -> Balance:
    """The balanced split of a per-block `profile` (one stage per block) for `schedule` on `n`
    ranks; logged at INFO on the `spectrax_mpmd` logger.

    The budget counts, per stage, its blocks' parameters, accumulators and optimizer
    estimate plus the activations its rank keeps at its peak (the schedule's peak
    live activations per rank, at unit costs) times what each block keeps per
    microbatch; a rank holding v stages gives each a v-th of the budget.
    """
    cost = profile.stage_cost()
    block_s = tuple(f + b for f, b in zip(cost.F, cost.B))
    overhead = fixed_cell_seconds(profile) * 2
    n_stages = n * schedule.virtual_stages
    block_bytes = activations = budget = None
    if memory_budget is not None:
        mem = profile.memory
        held = [r + k + s for r, k, s in zip(mem.residuals, mem.kept_inputs, mem.stash)]
        block_bytes = [(int(p * (2 + optimizer_states)), h) for p, h in zip(profile.stage_param_bytes, held)]
        peaks = S.simulate(schedule, n).peak_activations
        activations = [peaks[schedule.rank_of(k, n)] for k in range(n_stages)]
        budget = memory_budget / schedule.virtual_stages
    sizes = split_blocks(
        block_s,
        n_stages,
        overhead_s=overhead,
        block_bytes=block_bytes,
        activations=activations,
        budget=budget,
    )
    even = stage_sizes(len(block_s), n_stages)
    result = Balance(
        sizes,
        _stage_times(block_s, sizes, overhead),
        even,
        _stage_times(block_s, even, overhead),
        block_s,
        overhead,
        optimizer if memory_budget is not None else "",
    )
    log.info("stage_sizes='auto' for %s on %d ranks:\n%s", schedule, n, result.table())
    return result


def _stage_times(block_s: Sequence[float], sizes: Sequence[int], overhead_s: float) -> tuple[float, ...]:
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return tuple(float(sum(block_s[a:b]) - (b - a - 1) * overhead_s) for a, b in zip(bounds, bounds[1:]))


@outside_context_mesh
def balance(
    fn: Callable,
    *,
    mesh,
    schedule,
    n_blocks: int,
    memory_budget: int | None = None,
    tx: optax.GradientTransformation | None = None,
    optimizer_states: float | None = None,
    rounds: int = 2,
    devices: int | None = None,
    device_sizes: Sequence[int] = (1, 2, 4),
    device_axis: str = "tp",
    cost_model: str = "measured",
    **step_kwargs,
) -> Balance | DeviceBalance:
    """Balance a model of `n_blocks` blocks for `schedule` on `mesh` (see `Balance`).

    `fn(sizes)` returns `(loss_fn, args)` for the model cut into `len(sizes)` stages
    of `sizes[k]` blocks (markers after the blocks ending each stage), as
    `sxvalue_and_grad` takes them; `step_kwargs` go to `sxvalue_and_grad`.
    Against `memory_budget` the optimizer's state counts by default: with `tx`, as
    many copies of each block's parameters as `tx.init`'s state holds of the
    parameters (`jax.eval_shape`, nothing allocated); without it, Adam's two
    moments are assumed; `optimizer_states=k` sets the copies instead.
    `Balance.optimizer` says which.

    With `devices` (a device count), each stage's devices are chosen too: every
    block is profiled on a rank of each of `device_sizes` devices along
    `device_axis` (its `rules` resolve against that submesh), and the split of
    blocks and devices (at most `devices` in all) whose slowest stage is fastest
    is ranked against the even split by predicted step: a `DeviceBalance`
    (`spectrax_mpmd._planner.device_advice`; `print` it for the table and why).
    `cost_model` is `"measured"` (each block's seconds as measured on k devices) or
    `"work"` (its seconds on the fewest devices scaled by its FLOPs per device).
    On a mesh whose ranks differ in size (`mp.create_rank_mesh`), without `devices`, the
    devices are the mesh's: every block is profiled on a rank of each of its sizes (ranks of
    one size share one shape), and the layers are split with stage s on rank s (one stage
    per rank: Std1F1B, GPipe, Eager1F1B), ranked against the even blocks on those ranks (a
    `DeviceBalance` whose candidates are `"chosen"` and `"even"`).
    """

    settings = StepSettings.of("balance", locals(), **step_kwargs)
    options = Options(optimizer_states, rounds, devices, device_sizes, device_axis, cost_model)
    return balance_step(fn, n_blocks, settings, options)


@dataclass(frozen=True)
class Options:
    """How `balance` counts the optimizer's state and profiles (see `balance`)."""

    optimizer_states: float | None = None
    rounds: int = 2
    devices: int | None = None
    device_sizes: Sequence[int] = (1, 2, 4)
    device_axis: str = "tp"
    cost_model: str = "measured"


@outside_context_mesh
def auto_balance(cut: Callable, n_blocks: int, settings: StepSettings) -> Balance | DeviceBalance:
    """The split `stage_sizes="auto"` chooses for a run with `settings` (`run`, `Runner` and the
    eager `spx.run` alike): `balance` of the step the run differentiates, with every setting of
    it (weights, memory budget, rules, remat, offload, optimizer). `cut(sizes)` returns
    `(loss, args)` as `balance`'s `fn`."""
    step = settings.with_schedule().runner_step()
    return balance_step(cut, n_blocks, step, Options())


def balance_step(
    fn: Callable, n_blocks: int, settings: StepSettings, options: Options
) -> Balance | DeviceBalance:
    """`balance` of the step with `settings` (`settings.tx` the optimizer whose state counts)."""
    mesh, schedule, memory_budget = settings.pipeline_mesh, settings.schedule, settings.memory_budget
    tx, rounds, devices, cost_model = settings.tx, options.rounds, options.devices, options.cost_model
    if schedule is None:
        raise StageSplitError("balance: a schedule is required, e.g. schedule=Std1F1B(microbatches=8).")
    n_stages = mesh.mpmd_dim * schedule.virtual_stages
    if n_blocks < n_stages:
        split_blocks([0.0] * n_blocks, n_stages)  # raises, saying why
    loss, args = fn((1,) * n_blocks)
    copies, note = _optimizer_copies(tx, options.optimizer_states, args[0])
    if devices is None and not mesh.uniform:
        return balance_on_ranks(
            loss, args, settings, n_blocks, cost_model, optimizer_states=copies, rounds=rounds
        )
    if devices is not None:
        on = {"devices": devices, "sizes": options.device_sizes, "axis": options.device_axis}
        on |= {"blocks": n_blocks, "cost_model": cost_model}
        return balance_on_devices(loss, args, settings, on, optimizer_states=copies, rounds=rounds)
    per_block = per_block_schedule(schedule.microbatches, n_blocks)
    step = step_function(
        loss, settings.replace(mesh=one_rank_mesh(mesh), schedule=per_block), compiler=Compiler()
    )
    profile = step.profile_stages(*args, rounds=rounds)
    return balance_from_profile(
        profile, schedule, mesh.mpmd_dim, memory_budget=memory_budget, optimizer_states=copies, optimizer=note
    )


def _optimizer_copies(tx, optimizer_states, params) -> tuple[float, str]:
    """How many copies of the parameters the optimizer's state holds, and how that was found."""
    if optimizer_states is not None:
        return float(optimizer_states), f"state estimated as {optimizer_states:g} copies of the parameters"
    if tx is None:
        return float(ASSUMED_STATES), "assumed Adam (no tx given): two moments per parameter; pass tx="
    copies = _nbytes(jax.eval_shape(tx.init, params)) / max(1, _nbytes(params))
    return copies, f"from tx: its state holds {copies:.3g} copies of the parameters"


def _nbytes(tree) -> int:
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
