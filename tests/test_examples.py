"""The example scripts run: the pipeline LM trainer end to end (small), and `--help` everywhere."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(
    p for p in [*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py")] if not p.name.startswith("_")
)


HELP_ALL = """
import contextlib, io, os, runpy, sys
failed = []
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script, "--help"]
    sys.path.insert(0, os.path.dirname(script))  # as `python script.py` does
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        failed.append(f"{script}: --help did not exit")
    except SystemExit as stop:
        if stop.code not in (0, None) or "usage:" not in out.getvalue():
            failed.append(f"{script}: exit {stop.code!r}, output {out.getvalue()[-300:]!r}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_script_answers_help():
    """`--help` works for every example and benchmark script (one interpreter runs them all, so
    JAX is imported once)."""
    result = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(SCRIPTS) >= 10


def test_train_lm_trains_stops_and_resumes_on_another_layout(tmp_path):
    """The main job (small) trains through 4 ranks, checks its decode, stops after 5 steps
    (saved at 3 and 5); resuming from step 3 stops without touching step 5 unless --overwrite
    is given; with it a second run resumes from step 3 on 2 ranks and the loss curve goes on.
    The first run prints the detailed tables (--details), the second the short summary."""
    flags = "--steps 6 --batch 8 --seq 16 --d-model 32 --microbatches 4 --lr 1e-2"
    script = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *flags.split()]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    resume = ["--stages", "2", "--schedule", "ZeroBubbleH1", "--resume", "3", "--sample-tokens", "2"]
    runs = {
        "stopped": [
            *("--stages", "4", "--stop-after", "5", "--save-every", "3", "--sample-tokens", "6", "--details")
        ],
        "kept": resume,
        "resumed": [*resume, "--overwrite"],
    }
    metrics, stdout = {}, {}
    for name, extra in runs.items():
        cmd = [*script, *ckpt, *extra, "--out", str(tmp_path / name)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if name == "kept":  # the later step 5 is kept, and the run stops before training
            assert result.returncode == 1 and "later steps [5]" in result.stderr, result.stderr[-3000:]
            assert "--overwrite" in result.stderr and not (tmp_path / name / "metrics.json").exists()
            assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [3, 5]
            continue
        assert result.returncode == 0, result.stderr[-3000:]
        metrics[name] = json.loads((tmp_path / name / "metrics.json").read_text())
        stdout[name] = result.stdout
    stopped, resumed = metrics["stopped"], metrics["resumed"]
    assert stopped["mode"] == "mpmd" and stopped["stages"] == 4
    assert stopped["losses"][-1] < stopped["losses"][0]
    assert stopped["decode_identical"] is True
    trace = json.loads((tmp_path / "stopped" / "timeline.json").read_text())
    cells = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in cells} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["name"][0].isdigit() for e in cells)
    # the last rank's cells run its forward and backward as one: named FB, as the host table names them
    assert {e["cat"] for e in cells if e["tid"] == 3} == {"FB"} and "3FB0" in {e["name"] for e in cells}
    assert {e["cat"] for e in cells if e["tid"] < 3} == {"F", "B"}
    assert "compiling" in stdout["stopped"] and "pipelined decode" in stdout["stopped"]
    assert "host cost of one step" in stdout["stopped"] and "3 FB " in stdout["stopped"]
    assert stopped["host"] is not None and stopped["peak_bytes"] is not None
    # the default output is the short summary: no tables, no raw dicts
    short = stdout["resumed"]
    assert "pipeline bubble" in short and "pipelined decode" in short and "tokens/s" in short
    assert "host cost" not in short and "peak bytes" not in short and "{'" not in short
    assert resumed["host"] is None and resumed["peak_bytes"] is None
    assert 0 < resumed["simulated_bubble"] < 1 and resumed["simulated_step_s"] > 0
    if importlib.util.find_spec("matplotlib") is not None:  # the `examples` extra
        pngs = [tmp_path / name / png for name in metrics for png in ("loss.png", "timeline.png")]
        assert all(png.stat().st_size > 0 for png in pngs)
    # cells run one at a time leave each of 4 ranks idle at least 3/4 of the time; the schedule's
    # simulated bubble over the same cell times is what the pipeline would idle
    assert "not the pipeline bubble" in stdout["stopped"]
    assert "simulated with these measured cell times" in stdout["stopped"]
    assert stopped["cell_by_cell_idle"] >= 0.75 - 1e-9
    assert 0 < stopped["simulated_bubble"] < stopped["cell_by_cell_idle"]
    assert stopped["checkpoint"]["saved"] == [3, 5] and len(stopped["losses"]) == 5
    assert resumed["first_step"] == 3 and resumed["stages"] == 2 and len(resumed["losses"]) == 3
    assert resumed["checkpoint"]["restore_s"] > 0 and resumed["checkpoint"]["saved"] == [6]
    # steps 3 and 4 ran in both: the resumed run continues the curve, to fp32 rounding
    np.testing.assert_allclose(resumed["losses"][:2], stopped["losses"][3:5], rtol=1e-5)
    assert (
        "resumed at step 3" in stdout["resumed"] and "deleted the later checkpoints [5]" in stdout["resumed"]
    )
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [3, 6]


@pytest.mark.slow
def test_train_lm_takes_one_step_and_no_sample(tmp_path):
    """The main job's smallest run: one step (its learning-rate schedule still has a decay) and no
    sample (--sample-tokens 0: no decode, no gather); a step count below one is refused by name."""
    script = [sys.executable, str(ROOT / "examples" / "train_lm.py")]
    flags = "--steps 1 --sample-tokens 0 --stages 2 --batch 8 --seq 16 --d-model 32 --microbatches 2"
    out = tmp_path / "one"
    result = subprocess.run(
        [*script, *flags.split(), "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["losses"]) == 1 and np.isfinite(metrics["losses"][0])
    assert metrics["decode_identical"] is None and "decode" not in result.stdout
    refused = subprocess.run(
        [*script, "--steps", "0"], check=False, capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert refused.returncode == 2 and "--steps must be at least 1, got 0" in refused.stderr
