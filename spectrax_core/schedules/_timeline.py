"""The plain data of a simulation: the cost models `Cost` and `StageCost`, and its result,
`Timeline`, made of `Event`s (one per executed cell)."""

from __future__ import annotations

from dataclasses import dataclass

from ._actions import Cell, FusedAction


@dataclass(frozen=True)
class Cost:
    """Duration of each action kind and of one cross-rank transfer.

    `FB` is the duration of a fused forward+full-backward cell (default: F + B,
    no overlap gain). Defaults are the unit costs: T_F = T_I = T_W = 1,
    T_B = T_I + T_W = 2, no transfer latency.
    """

    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the field's name is the action kind
    W: float = 1.0
    comm: float = 0.0
    FB: float | None = None

    def __post_init__(self):
        for name in ("F", "B", "I", "W", "comm", "FB"):
            value = getattr(self, name)
            if value is None and name == "FB":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"Cost: {name} must be a non-negative number, received {value!r}.")

    def of(self, cell: Cell) -> float:
        """Duration of one cell."""
        if isinstance(cell, FusedAction):
            fwd, bwd = cell.parts
            if self.FB is not None and bwd.kind == "B":
                return float(self.FB)
            return float(getattr(self, fwd.kind) + getattr(self, bwd.kind))
        return float(getattr(self, cell.kind))


@dataclass(frozen=True)
class StageCost:
    """Per-stage durations: `F[s]`, `B[s]`, `I[s]`, `W[s]` are stage s's cells, `comm` one
    cross-rank transfer. A fused cell costs the sum of its parts.

    For pipelines whose stages differ (an embedding first, a head and loss last,
    blocks of other widths between); `Cost` is the uniform case.
    """

    F: tuple[float, ...]
    B: tuple[float, ...]
    I: tuple[float, ...]  # noqa: E741 - the field's name is the action kind
    W: tuple[float, ...]
    comm: float = 0.0

    def __post_init__(self):
        n = len(self.F)
        for name in ("F", "B", "I", "W"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or len(values) != n:
                raise ValueError(
                    f"StageCost: {name} must be a tuple with one duration per stage (as F has, {n}), "
                    f"received {values!r}."
                )
            for s, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                    raise ValueError(f"StageCost: {name}[{s}] must be a non-negative number, received {v!r}.")
        if isinstance(self.comm, bool) or not isinstance(self.comm, (int, float)) or self.comm < 0:
            raise ValueError(f"StageCost: comm must be a non-negative number, received {self.comm!r}.")

    @property
    def stages(self) -> int:
        return len(self.F)

    def of(self, cell: Cell) -> float:
        """Duration of one cell (the sum of its parts when fused)."""
        return float(sum(getattr(self, a.kind)[a.stage] for a in cell.parts))


@dataclass(frozen=True)
class Event:
    """One executed cell: `cell` ran on `rank` from `start` to `end`.

    `kind` names the cell as it ran: `cell.kind` (`F`, `B`, `I`, `W`, fused `F&B`) unless
    given. A measured step names each cell as its plan ran it: the loss stage's forward runs
    fused with its backward, as one `FB` cell (the name the host profile's table gives it).
    """

    rank: int
    cell: Cell
    start: float
    end: float
    kind: str = ""

    def __post_init__(self):
        if not self.kind:
            object.__setattr__(self, "kind", self.cell.kind)

    def label(self, stage_labels: tuple[str, ...] = (), show_stage: bool = True) -> str:
        """The cell's name with its kind as it ran: `2F5` (stage 2, F, microbatch 5), `3FB5`,
        `0F3&7B1`; with `stage_labels` the stage's name (`V1F5`); without `show_stage` no stage
        (`FB5`, the grid's form)."""
        parts = self.cell.parts
        kinds = self.kind.split("&")
        if len(kinds) != len(parts):
            kinds = [a.kind for a in parts]

        def one(a, kind):
            stage = (stage_labels[a.stage] if stage_labels else str(a.stage)) if show_stage else ""
            return f"{stage}{kind}{a.microbatch}"

        return "&".join(one(a, kind) for a, kind in zip(parts, kinds))


@dataclass(frozen=True)
class Timeline:
    """Result of `simulate`.

    `events[r]` are rank r's cells in order with their times; `busy[r]` and
    `idle[r]` sum to `makespan`; `bubble_fraction` = Σ idle / (n · makespan);
    `peak_activations[r]` is the most (stage, microbatch) activations live on
    rank r at once (live from the start of F to the end of B, or of W when the
    backward is split). `stage_labels` name the stages in grids and traces
    (empty: their numbers). `peak_bytes[r]` is rank r's peak in device bytes when `simulate`
    was given a `StageMemory` (None otherwise), `peak_host_bytes[r]` its peak in host bytes
    (values offloaded between their cell and their reader).
    """

    schedule_name: str
    n: int
    cost: Cost | StageCost
    events: tuple[tuple[Event, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    bubble_fraction: float
    peak_activations: tuple[int, ...]
    stage_labels: tuple[str, ...] = ()
    peak_bytes: tuple[int, ...] | None = None
    peak_host_bytes: tuple[int, ...] | None = None
