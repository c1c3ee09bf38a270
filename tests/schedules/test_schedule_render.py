"""Text grid and Chrome-trace export of a simulated timeline."""

import json

import pytest

from spectrax_core.schedules import (
    Cost,
    DualPipeV,
    InterleavedH1,
    Std1F1B,
    chrome_trace,
    render_grid,
    save_chrome_trace,
    simulate,
)


def test_grid_of_1f1b_two_ranks():
    # rank 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; rank 0: F0 F1, B0 [4,6], B1 [7,9]
    assert render_grid(simulate(Std1F1B(2), 2)) == (
        "rank 0 | F0 F1 .  .  B0 -  .  B1 -\nrank 1 | .  F0 B0 -  F1 B1 -  .  ."
    )


def test_grid_at_unit_backward_cost_has_one_column_per_cell():
    grid = render_grid(simulate(Std1F1B(4), 4, Cost(B=1)))
    assert grid.splitlines()[3] == "rank 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .  ."


def test_grid_shows_stages_when_a_rank_holds_several_and_fused_cells():
    lines = render_grid(simulate(DualPipeV(4), 2)).splitlines()
    assert lines[0].split()[3:7] == ["0F0", "0F1", "0F2", "3F0"]
    assert "0F3&3B1" in lines[0] and "2F2&1B0" in lines[1]
    plain = render_grid(simulate(InterleavedH1(4), 2), show_stage=False).splitlines()
    assert plain[0].split()[3:7] == ["F0", "F1", "F0", "F1"]


def test_grid_rejects_a_step_that_merges_cells():
    with pytest.raises(ValueError, match="step=2 is too coarse"):
        render_grid(simulate(Std1F1B(4), 2), step=2)
    with pytest.raises(TypeError, match="expected a Timeline"):
        render_grid(Std1F1B(4))


def test_chrome_trace(tmp_path):
    t = simulate(DualPipeV(4), 2)
    trace = chrome_trace(t, us_per_unit=10.0)
    cells = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(cells) == sum(len(row) for row in DualPipeV(4).actions(2))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"}
    first = t.events[1][0]
    (record,) = [e for e in cells if e["tid"] == 1 and e["ts"] == first.start * 10.0]
    assert (
        record["name"] == repr(first.cell) == f"{first.cell.stage}F0"
        and record["dur"] == (first.end - first.start) * 10.0
    )
    fused = next(e for e in cells if e["cat"] == "F&B")
    assert len(fused["args"]["actions"]) == 2 and "&" in fused["name"]
    path = save_chrome_trace(t, tmp_path / "trace.json", us_per_unit=10.0)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))
