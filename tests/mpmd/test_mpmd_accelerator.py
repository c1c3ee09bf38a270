"""On an accelerator (tests marked `accelerator`, skipped where JAX sees only CPU devices): one-rank
pipelines (Std1F1B; InterleavedH1 with two virtual stages) equal one `jax.jit` of the unsplit
function at the device's precision under `jax.default_matmul_precision("highest")` (within the
exactness contract's rtol 1e-5, atol 1e-6) and train; a byte LM cut into two stages on that rank
generates the unsplit model's tokens; its checkpoint reads back bit for bit onto the rank; the
host-cost table of its step is not zero.

The suite pins its own process to the CPU, so the checks run in a process of their own on JAX's
default platform (`accelerator_worker.py`), once per module. The same checks run on CPU devices
in `test_the_accelerator_checks_hold_on_the_cpu`, so that CI proves them without an accelerator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NO_ACCELERATOR = "JAX sees only CPU devices here: the accelerator checks need a TPU or GPU"


def run_worker(tmp_path: Path, *flags: str) -> dict:
    """The worker's report, run with the caller's environment less the suite's CPU pinning and
    compiler flags (`JAX_PLATFORMS`, `XLA_FLAGS`), unless `flags` ask for the CPU."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS") or flags}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    out = tmp_path / "accelerator.json"
    cmd = [sys.executable, str(HERE / "accelerator_worker.py"), str(out), str(tmp_path / "ckpt"), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    report = run_worker(tmp_path_factory.mktemp("accelerator"))
    if report["platform"] == "cpu":
        pytest.skip(NO_ACCELERATOR)
    return report["checks"]


def check_one_rank(check: dict) -> None:
    assert "error" not in check, check.get("error")
    assert check["loss_error"] <= 1 and check["grad_error"] <= 1, check  # in units of the tolerance
    assert check["losses"][-1] < check["losses"][0]


def check_lm(check: dict) -> None:
    assert "error" not in check, check.get("error")
    assert check["losses"][-1] < check["losses"][0] and check["decode_identical"]
    assert check["restored_step"] == 5 and check["restored_identical"] and check["restored_on_rank"]
    host = check["host"]
    assert host["per_cell_us"] > 0 and host["calls_per_cell_us"] > 0 and host["issue_s"] > 0
    assert all(row["issue_us"] > 0 for row in host["rows"]), check["host_table"]


@pytest.mark.accelerator
@pytest.mark.parametrize("schedule", ["Std1F1B", "InterleavedH1"])
def test_one_rank_pipelines_equal_one_jit_at_the_devices_precision_and_train(checks, schedule):
    check_one_rank(checks[schedule])


@pytest.mark.accelerator
def test_a_one_rank_lm_generates_checkpoints_and_profiles(checks):
    check_lm(checks["lm"])


@pytest.mark.slow
def test_the_accelerator_checks_hold_on_the_cpu(tmp_path):
    report = run_worker(tmp_path, "--cpu-too")
    assert report["platform"] == "cpu"
    for schedule in ("Std1F1B", "InterleavedH1"):
        check_one_rank(report["checks"][schedule])
    check_lm(report["checks"]["lm"])
