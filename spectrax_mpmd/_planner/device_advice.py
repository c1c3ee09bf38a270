"""`balance(devices=)`: the device split and the layer split, ranked by predicted step, and why.

Three candidates are simulated with the schedule, each rank with its own stage's
cells and bytes on its own device count (`spectrax_mpmd._planner.devices`): the
split `split_devices` chooses, the even split (even blocks, the same devices per
stage) and the layers balanced on the even device counts. The prediction is the
simulated step of the schedule, each rank computing on devices of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spectrax_core import schedules as S

from .._settings import StepSettings
from .._stages import stage_sizes
from ..errors import StageSplitError
from .block_costs import BlockCosts, check_cost_model, check_rank_mesh, profile_blocks, rank_meshes
from .devices import Split, even_devices, fitting, split_cost, split_devices, split_memory

log = logging.getLogger("spectrax_mpmd")
MODELS = {
    "measured": "as measured on a rank of k devices",
    "work": "the fewest devices' seconds scaled by the FLOPs per device on k",
}


@dataclass(frozen=True)
class DevicePlan:
    """One simulated split: `label` (`"chosen"`, `"even"`, `"layers only"`), its blocks and devices
    per stage, the predicted seconds per step, each rank's predicted peak bytes per device, and
    whether that fits the budget."""

    label: str
    split: Split
    step_s: float
    peak_bytes: tuple[int, ...]
    fits: bool


@dataclass(frozen=True)
class DeviceBalance:
    """Splits of blocks and devices ranked by predicted step (fitting ones first), with what the
    choice rests on: `heavy_stage` is the even split's slowest stage (as costed) and `heavy_s[k]` its
    forward plus backward seconds per microbatch on k devices, `(as measured, as costed)` under
    `cost_model` (one of `MODELS`)."""

    candidates: tuple[DevicePlan, ...]
    cost_model: str
    heavy_stage: int
    heavy_blocks: tuple[int, int]
    heavy_s: Mapping[int, tuple[float, float]]
    total: int
    memory_budget: int | None = None

    @property
    def best(self) -> DevicePlan:
        """The fastest split that fits (the first candidate)."""
        return self.candidates[0]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Blocks per stage of the best split (as `Balance.sizes`)."""
        return self.best.split.blocks

    @property
    def devices(self) -> tuple[int, ...]:
        """Devices per stage of the best split."""
        return self.best.split.devices

    def plan(self, label: str) -> DevicePlan:
        return next(c for c in self.candidates if c.label == label)

    def why(self) -> str:
        i, j = self.heavy_blocks
        counts = sorted(self.heavy_s)
        measured = ", ".join(f"{self.heavy_s[k][0] * 1e3:.3f} ms on {k}" for k in counts)
        costed = ", ".join(f"{self.heavy_s[k][1] * 1e3:.3f} ms on {k}" for k in counts)
        return (
            f"heaviest stage of the even split: stage {self.heavy_stage} (blocks {i}:{j}); forward+backward "
            f"per microbatch measured {measured} device(s); costed ({self.cost_model}: "
            f"{MODELS[self.cost_model]}) {costed}"
        )

    def table(self) -> str:
        def row(c: DevicePlan) -> str:
            peak = max(c.peak_bytes) / 2**20
            fit = "" if self.memory_budget is None else ("  fits" if c.fits else "  over budget")
            return (
                f"{c.label:11} blocks {c.split.blocks} devices {c.split.devices}  step "
                f"{c.step_s * 1e3:.3f} ms  peak {peak:.2f} MiB{fit}"
            )

        return "\n".join([*map(row, self.candidates), self.why()])

    def __str__(self) -> str:
        return self.table()


def balance_devices(
    costs: BlockCosts,
    schedule,
    n: int,
    total: int,
    *,
    cost_model: str = "measured",
    memory_budget: int | None = None,
    optimizer_states: float = 0.0,
    ranks: tuple[int, ...] | None = None,
) -> DeviceBalance:
    """Rank the chosen, even and layers-only splits of `costs`' blocks into `n` stages on at most
    `total` devices under `schedule` (see the module docstring); logged at INFO. With `ranks`
    (devices per rank, stage s on rank s), the devices are given: the layers balanced on them
    (`"chosen"`) against the even blocks on them."""
    check_cost_model(cost_model)
    check_device_schedule(schedule)
    seconds = costs.seconds(cost_model)
    fits = fitting(costs, schedule, n, memory_budget, optimizer_states)
    splits = (
        _candidates(seconds, costs, n, total, fits)
        if ranks is None
        else _on_ranks(seconds, costs, ranks, fits)
    )
    plans = [
        simulated(costs, schedule, label, split, cost_model, memory_budget, optimizer_states)
        for label, split in splits.items()
    ]
    plans.sort(key=lambda p: (not p.fits, p.step_s))
    heavy, bounds = _heaviest(seconds, splits["even"])
    measured = costs.seconds("measured")
    result = DeviceBalance(
        tuple(plans),
        cost_model,
        heavy,
        bounds,
        {k: (sum(measured[k][slice(*bounds)]), sum(seconds[k][slice(*bounds)])) for k in costs.sizes},
        total,
        memory_budget,
    )
    log.info("balance(devices=%d) for %s on %d ranks:\n%s", total, schedule, n, result.table())
    return result


def _candidates(seconds: dict, costs: BlockCosts, n: int, total: int, fits) -> dict[str, Split]:
    """The chosen split, the even one and the layers balanced on the even device counts."""
    even = even_devices(costs.sizes, n, total)
    splits = {
        "chosen": split_devices(seconds, n, total, fits=fits),
        "even": Split(stage_sizes(costs.blocks, n), even),
    }
    try:
        splits["layers only"] = split_devices({even[0]: seconds[even[0]]}, n, sum(even), fits=fits)
    except StageSplitError:
        pass  # nothing fits on the even device counts: the even split is listed as over budget
    return splits


def _on_ranks(seconds: dict, costs: BlockCosts, ranks: tuple[int, ...], fits) -> dict[str, Split]:
    """The layers balanced with stage s on `ranks[s]` devices, and the even blocks on them."""

    def on_its_rank(k: int, i: int, j: int, s: int) -> bool:
        return k == ranks[s] and (fits is None or fits(k, i, j, s))

    chosen = split_devices(seconds, len(ranks), sum(ranks), fits=on_its_rank)
    return {"chosen": chosen, "even": Split(stage_sizes(costs.blocks, len(ranks)), tuple(ranks))}


def balance_on_ranks(
    loss, args, settings: StepSettings, n_blocks: int, cost_model: str, *, optimizer_states, rounds
) -> DeviceBalance:
    """`balance` of the step with `settings` on a mesh whose ranks differ in size: every block
    profiled on a rank of each size (its own axes and rules: `rank_meshes`), the layers split
    with stage s on rank s (`balance_devices(ranks=)`)."""
    mesh, schedule, memory_budget = settings.pipeline_mesh, settings.schedule, settings.memory_budget
    check_cost_model(cost_model)
    check_device_schedule(schedule)
    meshes = rank_meshes(mesh)
    on = {"sizes": sorted(meshes), "meshes": meshes}
    costs = profile_blocks(loss, args, settings, n_blocks, on, rounds)
    ranks = mesh.rank_sizes
    return balance_devices(
        costs,
        schedule,
        mesh.mpmd_dim,
        sum(ranks),
        cost_model=cost_model,
        memory_budget=memory_budget,
        optimizer_states=optimizer_states,
        ranks=ranks,
    )


def advise_devices(source, on: dict, microbatches: int, memory_budget, optimizer_states: float, rounds: int):
    """`advise(devices=)`: the one-stage-per-rank cut of `source`'s function (an
    `spectrax_mpmd._planner.advice.Source`), each stage a block, ranked for Std1F1B at
    `microbatches` (`balance_on_devices`)."""
    n = source.mesh.mpmd_dim
    loss, args = (source.fn, source.args) if source.args else source.fn(n)
    settings = source.settings.replace(
        schedule=S.Std1F1B(microbatches=microbatches), memory_budget=memory_budget
    )
    return balance_on_devices(
        loss, args, settings, {**on, "blocks": n}, optimizer_states=optimizer_states, rounds=rounds
    )


def device_options(mesh, devices, sizes, axis, cost_model) -> dict | None:
    """`advise`'s device arguments as one checked mapping (`check_device_arguments`); None
    without `devices`."""
    if devices is None:
        return None
    on = {"devices": devices, "sizes": sizes, "axis": axis, "cost_model": cost_model}
    return {**on, "sizes": check_device_arguments(mesh, on)}


def check_device_arguments(mesh, on: dict) -> tuple[int, ...]:
    """`on["sizes"]` sorted, after every device argument in `on` is checked against `mesh` (before
    anything is profiled)."""
    check_cost_model(on["cost_model"])
    sizes = check_device_sizes(on["sizes"], on["devices"])
    check_rank_mesh(mesh, sizes, on["axis"])
    return sizes


def balance_on_devices(
    loss, args, settings: StepSettings, on: dict, *, optimizer_states: float, rounds: int
) -> DeviceBalance:
    """`balance(devices=)` of the step with `settings`: `loss` (cut at each of its `on["blocks"]`
    blocks) profiled on ranks of each of `on["sizes"]` devices along `on["axis"]`, its splits
    into `mesh.mpmd_dim` stages on at most `on["devices"]` devices ranked (`balance_devices`)."""
    mesh, schedule, memory_budget = settings.pipeline_mesh, settings.schedule, settings.memory_budget
    sizes = check_device_arguments(mesh, on)
    check_device_schedule(schedule)
    on = {**on, "sizes": sizes}
    costs = profile_blocks(loss, args, settings, on["blocks"], on, rounds)
    return balance_devices(
        costs,
        schedule,
        mesh.mpmd_dim,
        on["devices"],
        cost_model=on["cost_model"],
        memory_budget=memory_budget,
        optimizer_states=optimizer_states,
    )


def simulated(costs, schedule, label, split, cost_model, budget, optimizer_states) -> DevicePlan:
    """`split` simulated under `schedule`: its predicted step and per-rank peaks."""
    memory = split_memory(costs, split, optimizer_states)
    timeline = S.simulate(schedule, len(split.devices), split_cost(costs, split, cost_model), memory=memory)
    peaks = tuple(timeline.peak_bytes)
    return DevicePlan(label, split, timeline.makespan, peaks, budget is None or max(peaks) <= budget)


def _heaviest(seconds: dict, even: Split) -> tuple[int, tuple[int, int]]:
    """The even split's slowest stage under the cost model's `seconds`, and its blocks' bounds."""
    times = [sum(seconds[k][i:j]) for (i, j), k in zip(even.bounds(), even.devices)]
    s = max(range(len(times)), key=times.__getitem__)
    return s, even.bounds()[s]


def check_device_schedule(schedule) -> None:
    """The device split predicts one stage per rank with an unsplit backward."""
    if schedule.virtual_stages != 1 or schedule.splits_backward or schedule.layout != "flat":
        raise StageSplitError(
            f"balance(devices=), and balance on ranks of different sizes: the split is predicted for "
            f"schedules with one stage per rank and an unsplit backward (Std1F1B, GPipe, Eager1F1B); "
            f"received {schedule!r}. Choose the split with one of those, then advise the schedule on the "
            "mesh built from it."
        )


def check_device_sizes(sizes: Sequence[int], total: int) -> tuple[int, ...]:
    """`sizes` as a sorted tuple of distinct positive counts, each at most `total`."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise StageSplitError(
            f"balance: devices must be a positive int (the devices to split), received {total!r}."
        )
    counts = [isinstance(k, int) and not isinstance(k, bool) and 0 < k <= total for k in sizes]
    if not counts or not all(counts):
        raise StageSplitError(
            f"balance: device_sizes must be device counts between 1 and devices={total} (the ranks' sizes to "
            f"profile and choose from, e.g. (1, 2, 4)), received {sizes!r}."
        )
    return tuple(sorted(set(sizes)))
