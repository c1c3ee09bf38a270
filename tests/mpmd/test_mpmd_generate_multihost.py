"""Generation in a two-process job (CPU, loopback; 4 ranks, 2 per process): each process issues
its own ranks' cells, inputs crossing processes go through the job's transport, and every process
returns the unsplit model's tokens (greedy; seeded sampling with stop tokens and budgets, whose
finished group stops early), after an optimizer update without a recompile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_worker.py")
LIMIT = 180  # seconds for the whole job; a hang is killed with its process group


@pytest.mark.slow  # launched processes: 30-50 s on 2 shared cores
@pytest.mark.parametrize("transport", ["transfer", "ppermute"])
def test_two_processes_generate_the_unsplit_tokens(tmp_path, transport):
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
    try:
        out, _ = job.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        pytest.fail(f"the job ran past {LIMIT} s:\n{out.decode(errors='replace')[-3000:]}")
    assert job.returncode == 0, out.decode(errors="replace")[-3000:]
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    for record in records:
        assert len(record["tokens"]) == 4  # 2 updates x (greedy, seeded)
        assert record["tokens"] == record["reference"]
        assert record["compiles"] == 0  # the second update's parameters reuse the programs
    assert records[0]["tokens"] == records[1]["tokens"]
    assert records[0]["tokens"][0] != records[0]["tokens"][2]  # the update changed the greedy tokens
