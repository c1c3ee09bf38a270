"""The example scripts run: the pipeline LM trainer end to end (small), and `--help` everywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("examples/*.py"), *ROOT.glob("benchmarks/*.py")])


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


def test_train_lm_pipeline(tmp_path):
    flags = "--steps 6 --batch 8 --seq 16 --d-model 32 --microbatches 4 --sample-tokens 6 --lr 1e-2"
    cmd = [sys.executable, str(ROOT / "examples" / "train_lm.py"), *flags.split(), "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["mode"] == "mpmd" and metrics["stages"] == 4
    assert metrics["losses"][-1] < metrics["losses"][0]
    assert metrics["decode_identical"] is True
    trace = json.loads((tmp_path / "timeline.json").read_text())
    cells = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in cells} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 and e["name"][0].isdigit() for e in cells)
    assert "compiling" in result.stdout and "pipelined decode" in result.stdout
