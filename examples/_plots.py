"""The main job's pictures (`train_lm.py`): the loss curve and the step's timeline, with matplotlib.

The timeline figure has two panels, each on its own time scale. The upper one is the
pipeline as the schedule runs it on parallel devices: the schedule simulated
(`spectrax_core.schedules.simulate`) with the cell times measured below, then
each rank's optimizer update. The lower one is the measurement itself: one
step run cell by cell, one cell at a time on the whole machine, so no two
ranks overlap and most of each row is idle by construction. Cells are
coloured by the kind they ran as (the names of the grid and the host table:
`F`, `B`, `I`, `W`, the loss stage's fused `FB`, fused `F&B`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from spectrax_core.schedules import Cost, Event, StageCost, Timeline, render_grid, simulate

COLOURS = {
    "F": "#4c72b0",
    "B": "#dd8452",
    "I": "#c44e52",
    "W": "#8172b3",
    "FB": "#55a868",
    "F&B": "#937860",
    "update": "#8c8c8c",
}
MEANINGS = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input grad",
    "W": "W weight grad",
    "FB": "FB loss stage's F and B in one cell",
    "F&B": "F&B fused F and B",
    "update": "optimizer update",
}
FONT = 8  # points, for the labels inside cells


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def colour_kind(kind: str) -> str:
    """The legend entry a cell kind falls under: fused cells (`F&B`, `FB&B`) share one colour."""
    return "F&B" if "&" in kind else kind


def named_as_run(simulated: Timeline, measured: Timeline) -> list[list[Event]]:
    """`simulated`'s events named as `measured` ran the same cells (the loss stage's forward is
    the fused `FB` cell), without the cells that cost nothing (the loss stage's backward, run
    inside `FB`)."""
    ran_as = {e.cell: e.kind for row in measured.events for e in row}
    return [
        [Event(e.rank, e.cell, e.start, e.end, ran_as.get(e.cell, e.kind)) for e in row if e.end > e.start]
        for row in simulated.events
    ]


def grid_as_run(schedule, n: int, measured: Timeline, unit: Cost = Cost()) -> str:
    """The schedule's text grid at `unit` costs, each cell named as `measured` ran it, as in the
    timeline's pictures and the host table: a stage whose forward ran as the fused loss cell `FB`
    shows `FB` (costing F + B), and a cell that never ran (the loss stage's B, I and W, a first
    stage's I with nothing to return) is left out."""
    ran = {
        (a.stage, kind)
        for row in measured.events
        for e in row
        for a, kind in zip(e.cell.parts, e.kind.split("&"))
    }
    stages = range(schedule.num_stages(n))
    forward = tuple(unit.F + unit.B if (s, "FB") in ran else unit.F for s in stages)
    rest = (tuple(getattr(unit, k) if (s, k) in ran else 0.0 for s in stages) for k in "BIW")
    timeline = simulate(schedule, n, StageCost(forward, *rest, comm=unit.comm))
    rows = tuple(tuple(row) for row in named_as_run(timeline, measured))
    return render_grid(dataclasses.replace(timeline, events=rows))


def _draw(ax, rows, spans, n: int, x_max: float, show_stage: bool, stage_labels) -> None:
    """Rank rows of cells (and update `spans`, one `(start, end)` per rank, µs) on `ax`, in ms from
    0 to `x_max`."""
    ax.set_xlim(0, x_max)
    width_pt = ax.get_window_extent().width * 72 / ax.figure.dpi
    for rank, row in enumerate(rows):
        for e in row:
            kind = colour_kind(e.kind)
            start, length = e.start / 1e3, (e.end - e.start) / 1e3
            ax.broken_barh(
                [(start, length)],
                (rank - 0.4, 0.8),
                color=COLOURS.get(kind, "0.5"),
                lw=0.4,
                edgecolor="white",
            )
            label = e.label(stage_labels, show_stage)
            if length / x_max * width_pt >= 0.62 * FONT * len(label) + 2:  # only where the label fits
                ax.text(
                    start + length / 2, rank, label, ha="center", va="center", fontsize=FONT, color="white"
                )
    for rank, (start, end) in enumerate(spans):
        if end > start:
            ax.broken_barh(
                [(start / 1e3, (end - start) / 1e3)],
                (rank - 0.4, 0.8),
                color=COLOURS["update"],
                lw=0.4,
                edgecolor="white",
            )
    ax.set(ylabel="rank", yticks=range(n), ylim=(n - 0.5, -0.5))
    ax.grid(axis="x", alpha=0.3)


def plot_timeline(path: Path, run: str, simulated: Timeline, updated, measured: Timeline) -> bool:
    """Write the two-panel timeline PNG (see the module's docstring); `updated` is
    `schedules.with_update(simulated, ...)`. Returns False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    n = measured.n
    show_stage = bool(measured.stage_labels) or any(
        len({a.stage for e in row for a in e.cell.parts}) > 1 for row in measured.events
    )
    simulated_rows = named_as_run(simulated, measured)
    measured_rows = [list(row) for row in measured.events]
    kinds = {colour_kind(e.kind) for row in simulated_rows + measured_rows for e in row}
    kinds |= {"update"} if any(end > start for start, end in updated.spans) else set()
    order = [k for k in COLOURS if k in kinds]
    height = 2.3 + 2 * (0.6 + 0.45 * n)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, height))
    fig.subplots_adjust(left=0.05, right=0.99, top=1 - 0.75 / height, bottom=1.05 / height, hspace=0.45)
    _draw(
        top, simulated_rows, updated.spans, n, updated.makespan * 1.01e-3, show_stage, measured.stage_labels
    )
    top.set_title(
        f"simulated: the schedule on {n} parallel devices with the cell times measured below (sends "
        f"free), then each rank's optimizer update; {updated.makespan / 1e3:.2f} ms",
        fontsize=10,
    )
    _draw(bottom, measured_rows, [], n, measured.makespan * 1.01e-3, show_stage, measured.stage_labels)
    bottom.set_title(
        f"measured: one step run cell by cell, one cell at a time on the whole machine; "
        f"{measured.makespan / 1e3:.2f} ms (ranks never overlap: its idle time is not the bubble)",
        fontsize=10,
    )
    bottom.set_xlabel("ms")
    fig.suptitle(
        f"{run}: bubble {simulated.bubble_fraction:.0%}, step {updated.makespan / 1e3:.2f} ms "
        f"(simulated from measured cell times)",
        fontsize=12,
        fontweight="bold",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in order]
    labels = [MEANINGS[k] for k in order]
    fig.legend(handles, labels, loc="lower center", ncol=len(order), fontsize=9, frameon=False)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_loss(path: Path, run: str, first: int, losses: list[float]) -> bool:
    """Write the loss curve PNG, titled with the run; returns False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(first, first + len(losses)), losses)
    ax.set(xlabel="step", ylabel="loss (nats / byte)")
    ax.set_title(f"training loss\n{run}", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
