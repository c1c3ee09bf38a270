"""`spx.run` in a two-process job (CPU, loopback): each process's model advances its `Rngs` streams
alike, and losses, outputs and counters equal one process's run of the same script."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import run_rngs_worker as worker
from launching import launch

import spectrax_eager as spx

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_rngs_worker.py")
LIMIT = 150  # seconds for the whole job; a hang is killed with its process group


@pytest.mark.parametrize("transport", ["transfer", "ppermute"])
def test_two_processes_advance_the_streams_like_one(tmp_path, transport):
    job = launch(WORKER, tmp_path, nproc=2, devices=2, limit=LIMIT, timeout=30, transport=transport)
    reference = worker.trace(spx.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp"))
    code, out, _ = job.wait()
    assert code == 0, out[-3000:]
    records = [json.loads((tmp_path / f"process{p}.json").read_text()) for p in range(2)]
    for record in records:
        assert record["counts"] == reference["counts"] == [2, 4, 6, 8]
        np.testing.assert_allclose(record["losses"], reference["losses"], rtol=1e-5)
    held = [r["sums"] for r in records if r["sums"][0] is not None]
    assert len(held) == 1  # the outputs live on the last stage's process
    np.testing.assert_allclose(held[0], reference["sums"], rtol=1e-5, atol=1e-5)
    assert reference["losses"][0] != reference["losses"][1] and reference["sums"][0] != reference["sums"][1]
