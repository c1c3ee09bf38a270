"""Generation in a two-process job (CPU, loopback; 4 ranks, 2 per process): each process issues
its own ranks' cells, inputs crossing processes go through the job's transport, and every process
returns the unsplit model's tokens (greedy; seeded sampling with stop tokens and budgets, whose
finished group stops early), after an optimizer update without a recompile."""

from __future__ import annotations

import json
import os

import pytest
from launching import launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_worker.py")
LIMIT = 180  # seconds for the whole job; a hang is killed with its process group


@pytest.mark.slow  # launched processes: 30-50 s on 2 shared cores
@pytest.mark.parametrize("transport", ["transfer", "ppermute"])
def test_two_processes_generate_the_unsplit_tokens(tmp_path, transport):
    job = launch(WORKER, tmp_path, nproc=2, devices=2, limit=LIMIT, timeout=30, transport=transport)
    code, out, _ = job.wait()
    assert code == 0, out[-3000:]
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    for record in records:
        assert len(record["tokens"]) == 4  # 2 updates x (greedy, seeded)
        assert record["tokens"] == record["reference"]
        assert record["compiles"] == 0  # the second update's parameters reuse the programs
    assert records[0]["tokens"] == records[1]["tokens"]
    assert records[0]["tokens"][0] != records[0]["tokens"][2]  # the update changed the greedy tokens
