"""`StepDecoder` in a two-process job (CPU, loopback; 4 ranks, 2 per process): each process issues
its own ranks' cells of a user's decode step, the bundles crossing processes go through the job's
transport, and every process returns each prompt's tokens decoded alone and unsplit."""

from __future__ import annotations

import json
import os

import pytest
from launching import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_decode_worker.py")
LIMIT = 180  # seconds for the whole job; a hang is killed with its process group


@pytest.mark.slow  # launched processes
def test_two_processes_generate_each_prompt_alone(tmp_path):
    job = launch(WORKER, tmp_path, nproc=2, devices=2, limit=LIMIT, timeout=30, transport="transfer")
    code, out, _ = job.wait()
    assert code == 0, out[-3000:]
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    for record in records:
        assert record["tokens"] == record["reference"]
    assert records[0]["tokens"] == records[1]["tokens"]
