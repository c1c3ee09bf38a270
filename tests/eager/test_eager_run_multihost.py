"""`spx.run` in a two-process job (CPU, loopback): each process's model advances its `Rngs` streams
alike, and losses, outputs and counters equal one process's run of the same script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import run_rngs_worker as worker

import spectrax_eager as spx

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_rngs_worker.py")
LIMIT = 150  # seconds for the whole job; a hang is killed with its process group


@pytest.mark.parametrize("transport", ["transfer", "ppermute"])
def test_two_processes_advance_the_streams_like_one(tmp_path, transport):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_backend_optimization_level=0",
        PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]),
    )
    cmd = [sys.executable, "-m", "spectrax_mpmd.launch", "--nproc", "2", "--devices-per-proc", "2"]
    cmd += ["--timeout", "30", "--transport", transport, WORKER, str(tmp_path)]
    job = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    reference = worker.trace(spx.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp"))
    try:
        out, _ = job.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"the job ran past {LIMIT} s:\n{out.decode(errors='replace')[-3000:]}")
    assert job.returncode == 0, out.decode(errors="replace")[-3000:]
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    for record in records:
        assert record["counts"] == reference["counts"] == [2, 4, 6, 8]
        np.testing.assert_allclose(record["losses"], reference["losses"], rtol=1e-5)
    held = [r["sums"] for r in records if r["sums"][0] is not None]
    assert len(held) == 1  # the outputs live on the last stage's process
    np.testing.assert_allclose(held[0], reference["sums"], rtol=1e-5, atol=1e-5)
    assert reference["losses"][0] != reference["losses"][1] and reference["sums"][0] != reference["sums"][1]
