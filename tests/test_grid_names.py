"""The schedule's text grid, the timeline's pictures and the host table name a step's cells alike:
`F`, `B`, `I`, `W`, the loss stage's fused `FB`, fused `F&B` (the main job's `--details` grid is
`examples/_plots.grid_as_run`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B, ZeroBubbleH1

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import _plots  # noqa: E402


def loss_fn(ws, x):
    for k, w in enumerate(ws):
        x = jnp.tanh(x @ w)
        if k < len(ws) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean(x**2)


def kinds_in_grid(grid: str) -> set[str]:
    """Every cell kind a grid shows (`FB3` → `FB`, `0F3&7B1` → `F`, `B`)."""
    cells = [c for line in grid.splitlines() for c in line.split("|", 1)[1].split()]
    return {re.sub(r"\d", "", part) for c in cells if c not in ("-", ".") for part in c.split("&")}


@pytest.fixture(scope="module", params=[Std1F1B, ZeroBubbleH1], ids=lambda c: c.__name__)
def measured(request):
    schedule = request.param(microbatches=2)
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
    step = mp.sxvalue_and_grad(loss_fn, mesh=mesh, schedule=schedule)
    args = ([jnp.full((4, 4), 0.1), jnp.full((4, 4), 0.2)], jnp.ones((4, 4)))
    return schedule, step.measure_timeline(*args), step.profile(*args, rounds=1)


def test_grid_timeline_and_host_table_name_cells_alike(measured):
    schedule, timeline, host = measured
    grid = _plots.grid_as_run(schedule, 2, timeline)
    in_timeline = {k for row in timeline.events for e in row for k in e.kind.split("&")}
    in_host = {row.kind for row in host.rows} & set(_plots.MEANINGS)
    assert kinds_in_grid(grid) == in_timeline == in_host
    assert "FB" in in_timeline and set(in_timeline) <= set(_plots.MEANINGS)
    last = grid.splitlines()[-1]
    assert "FB0" in last and not re.search(r"\b[BIW]\d", last), last  # the loss stage runs only FB


def test_the_grid_keeps_the_schedule_order(measured):
    """Naming cells as they ran changes labels, not the order: rank 0's cells are the schedule's,
    less those the step never runs (a first stage's I cell has nothing to return)."""
    schedule, timeline, _ = measured
    first = _plots.grid_as_run(schedule, 2, timeline).splitlines()[0].split("|", 1)[1].split()
    ran = {(e.cell.stage, e.kind) for e in timeline.events[0]}
    expected = [f"{a.kind}{a.microbatch}" for a in schedule.actions(2)[0] if (a.stage, a.kind) in ran]
    assert len(expected) >= 4
    assert [c for c in first if c not in ("-", ".")] == expected
