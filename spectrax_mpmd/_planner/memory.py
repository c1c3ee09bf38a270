"""Bytes and seconds of a choice of recompute and offload per stage, from profiles of steps made
without that choice.

What a stage keeps for its backward depends on its own setting only: its
residuals (or, recomputing, its kept inputs) and its stash are those of a step
profiled with the same `remat` value, whatever the other stages do. Offload
moves the values `spectrax_mpmd._trace.policy.offloaded` picks (the rule the
plan builder follows) from device to host bytes, and costs each offloaded value's
copies at the measured fixed cost and bandwidth (`spectrax_mpmd._planner.backend`):
once to the host after the cell that makes it, and once back before each cell
that reads it. A recomputing stage's backward runs its forward again, at the
forward's measured time (`MemoryChoice.recompute_s`); the step is predicted from
the measured cells of a step that recomputes (its forward saves less, its backward
runs the forward again), so what recompute nets on this backend is what counts.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from spectrax_core.schedules import StageCost, StageMemory

from .._runtime import StageProfile
from .._trace.policy import NO_OFFLOAD, Offload, offloaded
from .backend import BackendCost

_STAGE_FIELDS = ("inputs", "kept_inputs", "residuals", "grads", "stash")


def host_bytes(profile: StageProfile, s: int, offload: Offload) -> tuple[int, int]:
    """`(residual bytes, stash bytes)` of one microbatch that `offload` moves to host on stage `s`."""
    res, stash = moved_values(profile, s, offload)
    return sum(res), sum(stash)


def chosen_memory(
    profiles: Mapping, remat: Sequence, offload: Sequence[Offload], optimizer: tuple | None = None
) -> StageMemory:
    """The `StageMemory` of a step whose stage `s` recomputes as `remat[s]` and offloads as
    `offload[s]`, from `profiles[value]`, the `StageProfile` of a step with `remat=value` (for
    each value used; none offloading). Per-rank bytes come from any of them (they agree);
    `optimizer` replaces the optimizer state's bytes."""
    first = next(iter(profiles.values())).memory
    per_stage: dict = {name: [] for name in (*_STAGE_FIELDS, "host_residuals", "host_stash")}
    for s, (value, o) in enumerate(zip(remat, offload)):
        profile = profiles[value]
        res_host, stash_host = host_bytes(profile, s, o)
        for name in _STAGE_FIELDS:
            per_stage[name].append(getattr(profile.memory, name)[s])
        per_stage["residuals"][s] -= res_host
        per_stage["stash"][s] -= stash_host
        per_stage["host_residuals"].append(res_host)
        per_stage["host_stash"].append(stash_host)
    memory = replace(first, **{name: tuple(v) for name, v in per_stage.items()})
    return memory if optimizer is None else replace(memory, optimizer=optimizer)


def moved_values(profile: StageProfile, s: int, offload: Offload) -> tuple[list[int], list[int]]:
    """Device bytes of each residual and each stash value of stage `s` that `offload` moves."""
    res, stash = profile.saved_values[s]
    return _picked(res, offload.residuals), _picked(stash, offload.stash)


def _picked(values, share: float) -> list[int]:
    """Device bytes of the values (`(selection bytes, device bytes)` each) a share moves."""
    return [values[k][1] for k in offloaded([g for g, _ in values], share)]


def copy_seconds(profile: StageProfile, s: int, offload: Offload, backend: BackendCost) -> dict[str, tuple]:
    """Per cell kind, `(seconds, copies)` of stage `s`'s host copies for one microbatch, each value
    one copy at the measured fixed cost plus its bytes over the bandwidth of its direction:
    residuals out after F and back before B (or before I and again before W), the stash out
    after I and back before W."""
    res, stash = moved_values(profile, s, offload)
    out_res, out_stash = (sum(map(backend.out.seconds, v)) for v in (res, stash))
    back_res, back_stash = (sum(map(backend.back.seconds, v)) for v in (res, stash))
    r, k = len(res), len(stash)
    return {
        "F": (out_res, r),
        "B": (back_res, r),
        "I": (back_res + out_stash, r + k),
        "W": (back_res + back_stash, r + k),
    }


def chosen_cost(
    timing: Mapping,
    profiles: Mapping,
    remat: Sequence,
    offload: Sequence[Offload],
    backend: BackendCost,
    comm: float = 0.0,
) -> StageCost:
    """The `StageCost` of the same choice: each stage's cells as measured in `timing[remat[s]]`, a
    timed profile of the step with that `remat` (a recomputing backward runs its forward again;
    its forward saves less), plus the host copies of the values `profiles[remat[s]]` saves
    (`copy_seconds`), as if they did not overlap. On CPU devices (`backend.shares_host`) the
    issuing thread makes each copy itself, so a copy's time is the step's issuing (`predict`
    charges every copy there) and not the cell's as well; on an accelerator a copy is a transfer
    the host only enqueues, and both are paid."""
    rows: dict = {"F": [], "B": [], "I": [], "W": []}
    costs = {r: t.stage_cost(comm=comm) for r, t in timing.items()}
    for s, (r, o) in enumerate(zip(remat, offload)):
        extra = copy_seconds(profiles[r], s, o, backend)
        for kind in rows:
            moved = 0.0 if backend.shares_host else extra[kind][0]
            rows[kind].append(getattr(costs[r], kind)[s] + moved)
    return StageCost(*(tuple(rows[k]) for k in "FBIW"), comm=comm)


@dataclass(frozen=True)
class MemoryChoice:
    """What a stage keeps for its backward, chosen to fit a budget: per model stage `remat` and
    `offload` (as `sxvalue_and_grad` takes them), each rank's predicted peak host bytes, the
    predicted seconds per step its host copies (`copies` of them, at the measured `backend`
    costs) add to the cells, and the measured seconds of the forwards it recomputes."""

    remat: tuple
    offload: tuple
    host_peak_bytes: tuple[int, ...]
    transfer_s: float
    recompute_s: float
    copies: int
    backend: BackendCost

    @property
    def bandwidth(self) -> float:
        """The fitted device -> host bandwidth, bytes per second."""
        return self.backend.out.bandwidth

    def label(self) -> str:
        """Short: the stages offloading (`off`) and recomputing (`rc`), e.g. `off 0-2 rc 3`."""
        off = [s for s, o in enumerate(self.offload) if o.residuals or o.stash]
        rc = [s for s, r in enumerate(self.remat) if r]
        parts = [f"{name} {_spans(stages)}" for name, stages in (("off", off), ("rc", rc)) if stages]
        return " ".join(parts) or "keep"

    def describe(self) -> str:
        host = " ".join(f"{b / 2**20:.2f}" for b in self.host_peak_bytes)
        return (
            f"{self.label()}: {self.copies} host copies {self.transfer_s * 1e3:.2f} ms, recompute "
            f"{self.recompute_s * 1e3:.2f} ms per step; host peak MiB {host}"
        )

    def as_dict(self) -> dict:
        return {
            "remat": list(self.remat),
            "offload": [{"residuals": o.residuals, "stash": o.stash} for o in self.offload],
            "host_peak_bytes": list(self.host_peak_bytes),
            "transfer_s": self.transfer_s,
            "recompute_s": self.recompute_s,
            "copies": self.copies,
            "backend": self.backend.as_dict(),
        }


def _spans(stages: list[int]) -> str:
    """`[0, 1, 2, 5]` as `0-2,5`."""
    runs: list[list[int]] = []
    for s in stages:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


LEVELS = (  # per stage, in the order a budget reaches for them: keep, offload, recompute
    (False, NO_OFFLOAD),
    (False, Offload(1.0, 1.0)),
    (True, Offload(0.0, 1.0)),
)


def choose_levels(stages: int, evaluate: Callable, budget: float) -> tuple[int, ...] | None:
    """Per stage, an index into `LEVELS` whose largest predicted peak fits `budget`, or None.

    `evaluate(levels) -> (peak bytes per rank, predicted seconds)`. Greedy: from keeping
    everything, raise one stage's level at a time, the one that costs the fewest added seconds
    per byte it takes off the ranks' excess over the budget, until the peaks fit.
    """
    levels = (0,) * stages
    peaks, seconds = evaluate(levels)

    def excess(p) -> float:
        return sum(max(0.0, b - budget) for b in p)

    while max(peaks) > budget:
        best = None
        for s in range(stages):
            if levels[s] + 1 == len(LEVELS):
                continue
            trial = levels[:s] + (levels[s] + 1,) + levels[s + 1 :]
            p, t = evaluate(trial)
            saved = excess(peaks) - excess(p)
            if saved > 0 and (best is None or (t - seconds) / saved < best[0]):
                best = ((t - seconds) / saved, trial, p, t)
        if best is None:
            return None
        _, levels, peaks, seconds = best
    return levels


def least_peak_levels(schedule, n: int, peaks_of: Callable) -> tuple[int, ...]:
    """Per model stage, an index into `LEVELS` under which each rank's predicted peak is the least
    any choice reaches. A rank's peak depends only on the levels of the stages it holds, so every
    combination of levels over a rank's stages is tried on all ranks at once (`3 ** k`
    predictions, `k` the most stages a rank holds) and each rank keeps its best.
    `peaks_of(levels) -> peak bytes per rank`."""
    held: list[list[int]] = [[] for _ in range(n)]
    for s in range(schedule.num_stages(n)):
        rank, model = schedule.rank_of(s, n), schedule.model_stage(s, n)
        if model not in held[rank]:
            held[rank].append(model)
    best: list = [None] * n  # per rank: (peak, levels of its stages)

    def levels_of(picks) -> tuple[int, ...]:
        levels = [0] * schedule.num_model_stages(n)
        for stages, pick in zip(held, picks):
            for model, k in zip(stages, pick):
                levels[model] = k
        return tuple(levels)

    for pick in itertools.product(range(len(LEVELS)), repeat=max(map(len, held))):
        peaks = peaks_of(levels_of([pick] * n))
        for r in range(n):
            if best[r] is None or peaks[r] < best[r][0]:
                best[r] = (peaks[r], pick)
    return levels_of([b[1] for b in best])


def fitted(schedule, n: int, timing: Mapping, holding: Mapping, step: Callable, budget: float, backend):
    """The cheapest per-stage choice (`choose_levels`) under which `schedule` fits `budget`, or, when
    that finds none, the choice with the least peak on every rank (`least_peak_levels`), which
    fits if any does: `(MemoryChoice, memory, cost)`. `timing[remat]` and `holding[remat]` are
    the profiles whose cells time the schedule and whose buffers size it;
    `step(memory, cost, copies)` predicts a step (`spectrax_mpmd._planner.predict.Predicted`)."""
    stages, m = schedule.num_model_stages(n), schedule.microbatches
    kinds = "FIW" if schedule.splits_backward else "FB"

    def chosen(levels):
        remat = tuple(LEVELS[k][0] for k in levels)
        offload = tuple(LEVELS[k][1] for k in levels)
        memory = chosen_memory(holding, remat, offload)
        if not schedule.splits_backward:
            memory = replace(memory, stash=(0,) * stages, host_stash=(0,) * stages)
        copies = [copy_seconds(holding[r], s, o, backend) for s, (r, o) in enumerate(zip(remat, offload))]
        count = m * sum(c[k][1] for c in copies for k in kinds)
        transfer = m * sum(c[k][0] for c in copies for k in kinds)
        return remat, offload, memory, chosen_cost(timing, holding, remat, offload, backend), count, transfer

    def evaluate(levels):
        *_, memory, cost, count, _ = chosen(levels)
        predicted = step(memory, cost, count)
        return predicted.peaks, predicted.seconds

    levels = choose_levels(stages, evaluate, budget)
    if levels is None:
        levels = least_peak_levels(schedule, n, lambda levels: evaluate(levels)[0])
    remat, offload, memory, cost, count, transfer = chosen(levels)
    timeline = step(memory, cost, count).timeline
    forward = timing[False].stage_cost().F
    recompute = m * sum(forward[s] for s, r in enumerate(remat) if r and s < stages - 1)
    choice = MemoryChoice(remat, offload, timeline.peak_host_bytes, transfer, recompute, count, backend)
    return choice, memory, cost


def run_ahead_bytes(memory, schedule, n: int, limit: int | None) -> tuple[int, ...]:
    """Per rank, the bytes beyond the predicted (issue-order) peak a runtime that allocates each
    program's outputs at enqueue can hold when a rank has up to `limit` cells issued ahead of its
    oldest unfinished one (`spectrax_mpmd._runtime.run_ahead`): the buffers that `limit - 1`
    queued cells read last stay until those cells run, at most what one microbatch of the
    rank's largest stage holds between cells (received inputs, residuals, received cotangents,
    stash) per queued cell. `limit=1` adds nothing; `limit=None` (no bound) has no bound and
    raises."""
    if limit is None or isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(
            f"run_ahead_bytes: limit must be a positive number of cells (an unbounded run-ahead has no "
            f"bound on its bytes), received {limit!r}."
        )
    held = [
        memory.inputs[s] + memory.kept_inputs[s] + memory.residuals[s] + memory.grads[s] + memory.stash[s]
        for s in range(memory.stages)
    ]
    per_rank = [0] * n
    for s in range(schedule.num_stages(n)):
        rank, model = schedule.rank_of(s, n), schedule.model_stage(s, n)
        per_rank[rank] = max(per_rank[rank], held[model])
    return tuple((limit - 1) * b for b in per_rank)
