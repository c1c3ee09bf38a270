"""Region pipelines: several schedules, one per branch of a model, merged into one table.

A multimodal model is a DAG of pipelines — a vision tower and a text tower
that meet where the text reads the vision features. Each `Region` runs its own
schedule on its own ranks over its own stages; `RegionSchedule` numbers every
stage globally, knows which stages feed which (`edges`), and merges the
regions' tables into one row per rank that respects those dependencies. It is
a `Schedule`: `actions`, `simulate`, `render_grid` and `chrome_trace` work on
it as on a single pipeline, with stages named by region (`V1F3`, `T0B2`).

Microbatches: every region runs the same `m`; microbatch i of one region is
microbatch i of every other (the batch is split once).
"""

from __future__ import annotations

from dataclasses import dataclass

from ._actions import Action, FusedAction, ScheduleError, cell_label
from ._base import Schedule
from ._flow import DeadlockError, Flow, issue_order


@dataclass(frozen=True)
class Region:
    """One branch: `schedule` on `ranks` (local rank j is global rank `ranks[j]`); its local
    stage j is global stage `stages[j]`."""

    name: str
    schedule: Schedule
    ranks: tuple[int, ...]
    stages: tuple[int, ...]


def region_labels(names: tuple[str, ...]) -> tuple[str, ...]:
    """Short stage-name prefixes: the shortest upper-cased prefix of each name that no other
    name shares (`vision`, `text` → `V`, `T`; `text`, `tokens` → `TE`, `TO`)."""
    labels = []
    for name in names:
        others = [o.upper() for o in names if o != name]
        k = 1
        while k < len(name) and any(o.startswith(name[:k].upper()) for o in others):
            k += 1
        labels.append(name[:k].upper())
    return tuple(labels)


@dataclass(frozen=True)
class RegionSchedule(Schedule):
    """The merged schedule of several regions on `sum` of their ranks (ranks may be shared).

    `edges` are `(source stage, destination stage)` pairs of global stages whose
    forward output the destination reads (inside a region and across regions);
    `gradient_edges` those of them that carry a gradient back (default: all).
    """

    regions: tuple[Region, ...]
    edges: tuple[tuple[int, int], ...]
    gradient_edges: tuple[tuple[int, int], ...] | None = None

    layout = "regions"

    def __post_init__(self):
        if not self.regions:
            raise ScheduleError("RegionSchedule: needs at least one Region.")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            twice = sorted({x for x in names if names.count(x) > 1})
            raise ScheduleError(f"RegionSchedule: region name(s) {twice} used more than once.")
        ms = {r.name: r.schedule.microbatches for r in self.regions}
        if len(set(ms.values())) > 1:
            raise ScheduleError(
                f"RegionSchedule: every region must run the same number of microbatches (the batch "
                f"is split once and microbatch i flows through every region); got {ms}. Give each "
                "region's schedule the same microbatches=."
            )
        for r in self.regions:
            self._check_region(r)
        stages = sorted(s for r in self.regions for s in r.stages)
        if stages != list(range(len(stages))):
            raise ScheduleError(
                f"RegionSchedule: the regions' stages must number 0..{len(stages) - 1} once each; "
                f"got {stages}."
            )
        ranks = sorted({j for r in self.regions for j in r.ranks})
        if ranks != list(range(len(ranks))):
            raise ScheduleError(f"RegionSchedule: the regions must use ranks 0..k without gaps; got {ranks}.")
        for src, dst in (*self.edges, *(self.gradient_edges or ())):
            if not (0 <= src < len(stages) and 0 <= dst < len(stages)) or src == dst:
                raise ScheduleError(
                    f"RegionSchedule: edge {(src, dst)} must join two different stages in 0..{len(stages) - 1}."
                )
        self._check_acyclic(len(stages))

    def _check_region(self, r: Region) -> None:
        where = f"RegionSchedule: region {r.name!r}"
        if not isinstance(r.schedule, Schedule):
            raise ScheduleError(f"{where}: schedule must be a Schedule, received {r.schedule!r}.")
        n = len(r.ranks)
        if n >= 1 and any(r.schedule.model_stage(s, n) != s for s in range(r.schedule.num_stages(n))):
            raise ScheduleError(
                f"{where}: {type(r.schedule).__name__} runs copies of the model's stages, which a region "
                "cannot hold (its stages are the region's own); use DualPipeV there."
            )
        if n < 1 or len(set(r.ranks)) != n or min(r.ranks) < 0:
            raise ScheduleError(f"{where}: ranks must be distinct non-negative ints, received {r.ranks}.")
        if len(r.stages) != r.schedule.num_stages(n):
            raise ScheduleError(
                f"{where} has {len(r.stages)} stage(s), but {r.schedule!r} on its {n} rank(s) runs "
                f"{r.schedule.num_stages(n)} (ranks x virtual stages). Give the region "
                f"{r.schedule.num_stages(n) - 1} stage marker(s), or change its ranks or schedule."
            )
        try:
            r.schedule.validate(n)
        except ScheduleError as err:
            raise ScheduleError(f"{where}: its schedule is not valid on {n} rank(s): {err}") from None

    def _check_acyclic(self, n_stages: int) -> None:
        cycle = _cycle(self.edges, n_stages)
        if cycle:
            labels = self.stage_labels(self.n_ranks)
            raise ScheduleError(
                "RegionSchedule: the stages form a cycle ("
                + " -> ".join(labels[s] for s in (*cycle, cycle[0]))
                + "); data must flow one way between regions."
            )

    # --- the layout ------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.regions[0].schedule.microbatches

    @property
    def n_ranks(self) -> int:
        return 1 + max(j for r in self.regions for j in r.ranks)

    @property
    def virtual_stages(self) -> int:
        """The most stages any rank holds."""
        return max(len(self.stages_of(j, self.n_ranks)) for j in range(self.n_ranks))

    @property
    def splits_backward(self) -> bool:
        return any(r.schedule.splits_backward for r in self.regions)

    def _locate(self, stage: int) -> tuple[Region, int]:
        for r in self.regions:
            if stage in r.stages:
                return r, r.stages.index(stage)
        raise ScheduleError(
            f"RegionSchedule: stage must be in 0..{self.num_stages(self.n_ranks) - 1}, received {stage}."
        )

    def _check_ranks(self, n: int) -> None:
        if n != self.n_ranks:
            raise ScheduleError(f"RegionSchedule: its regions use {self.n_ranks} ranks, not n={n}.")

    def num_stages(self, n: int) -> int:
        return sum(len(r.stages) for r in self.regions)

    def rank_of(self, stage: int, n: int) -> int:
        r, local = self._locate(stage)
        return r.ranks[r.schedule.rank_of(local, len(r.ranks))]

    def stages_of(self, rank: int, n: int) -> tuple[int, ...]:
        self._check_ranks(n)
        return tuple(
            r.stages[local]
            for r in self.regions
            if rank in r.ranks
            for local in r.schedule.stages_of(r.ranks.index(rank), len(r.ranks))
        )

    def stage_of(self, rank: int, v: int, n: int) -> int:
        stages = self.stages_of(rank, n)
        if not 0 <= v < len(stages):
            raise ScheduleError(f"RegionSchedule: rank {rank} holds {len(stages)} stage(s), received v={v}.")
        return stages[v]

    def flow(self, n: int) -> Flow:
        return Flow.from_edges(self.num_stages(n), self.edges, self.gradient_edges)

    def stage_inputs(self, n: int) -> tuple[tuple[int, ...], ...]:
        return self.flow(n).inputs

    def gradient_inputs(self, n: int) -> tuple[tuple[int, ...], ...]:
        return self.flow(n).gradient_inputs

    def stage_labels(self, n: int) -> tuple[str, ...]:
        prefixes = region_labels(tuple(r.name for r in self.regions))
        labels = [""] * self.num_stages(n)
        for prefix, r in zip(prefixes, self.regions):
            for local, s in enumerate(r.stages):
                labels[s] = f"{prefix}{local}"
        return tuple(labels)

    # --- the merged table ------------------------------------------------------------
    def _depth_after(self, stage: int, n: int) -> int:
        """How many stages the longest path from `stage` to the end of the model passes."""
        feeds = Flow.from_edges(self.num_stages(n), self.edges).gradient_inputs  # the stages reading s
        depth: dict[int, int] = {}

        def walk(s: int) -> int:
            if s not in depth:
                depth[s] = max((1 + walk(d) for d in feeds[s]), default=0)
            return depth[s]

        return walk(stage)

    def _region_rows(self, r: Region, n: int) -> tuple:
        """The region's own table. A one-stage-per-rank schedule whose region feeds `e` more
        stages runs as the first ranks of the same schedule on `ranks + e` ranks: its warm-up
        then covers the whole path to the loss (a 1F1B region feeding another would
        otherwise run its first backward before the forward the other region waits for)."""
        n_r = len(r.ranks)
        extra = self._depth_after(r.stages[-1], n) if r.schedule.layout == "flat" else 0
        return r.schedule.actions(n_r + extra)[:n_r]

    def _check_n(self, n: int) -> None:
        self._check_ranks(n)

    def _rows(self, n: int) -> list[list]:
        """Each region's rows (`_region_rows`) on global stages, merged per rank in dependency
        order: every (region, rank) row is a queue of `issue_order`. When every queue waits — a
        region's backward needs a gradient that another region sends only after more forwards —
        the first forward that can run moves ahead of its queue's waiting cell (`_overtake`),
        so any acyclic set of regions merges."""
        owners, ranks, queues = [], [], []
        for r in self.regions:
            for local_rank, row in enumerate(self._region_rows(r, n)):
                owners.append(r)
                ranks.append(r.ranks[local_rank])
                queues.append([_globalize(c, r.stages) for c in row])
        try:
            order = issue_order(queues, self.flow(n), ranks=ranks, unblock=_overtake)
        except DeadlockError as err:
            labels = self.stage_labels(n)
            stuck = "; ".join(
                f"region {owners[s.queue].name!r} on rank {s.rank} at {cell_label(s.cell, labels)}"
                for s in err.stuck
            )
            raise DeadlockError(
                f"RegionSchedule: the regions' tables deadlock once merged ({stuck}).", err.stuck
            ) from None
        rows: list[list] = [[] for _ in range(n)]
        for rank, cell in order:
            rows[rank].append(cell)
        return rows


def _overtake(left: tuple[tuple, ...], ready) -> tuple[tuple, ...] | None:
    """`left` with the first ready forward of some queue moved ahead of that queue's waiting
    cell (a fused cell gives up its forward part and keeps its place); None if there is none."""
    for q, row in enumerate(left):
        for j, cell in enumerate(row):
            forward = cell.parts[0]
            if forward.kind == "F" and ready(forward):
                moved = (forward, *row[:j], *cell.parts[1:], *row[j + 1 :])
                return (*left[:q], moved, *left[q + 1 :])
    return None


def _globalize(cell, stages: tuple[int, ...]):
    """`cell` of a region's own table, on global stage numbers."""
    if isinstance(cell, FusedAction):
        return FusedAction(tuple(_globalize(p, stages) for p in cell.parts))
    return Action(cell.kind, stages[cell.stage], cell.microbatch)


def _cycle(edges, n_stages: int) -> list[int]:
    """A cycle among the stages joined by `edges` (its stages in order), or [] when there is none."""
    feeds: dict[int, set[int]] = {s: set() for s in range(n_stages)}
    for src, dst in edges:
        feeds[src].add(dst)
    indegree = {s: 0 for s in range(n_stages)}
    for dsts in feeds.values():
        for d in dsts:
            indegree[d] += 1
    ready = [s for s, k in indegree.items() if k == 0]
    while ready:
        for d in feeds[ready.pop()]:
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append(d)
    left = {s for s, k in indegree.items() if k > 0}
    if not left:
        return []
    path, node = [], min(left)  # every stage left is on or behind a cycle: walk back until one repeats
    while node not in path:
        path.append(node)
        node = next(src for src in left if node in feeds[src])
    return path[path.index(node) :][::-1]
