"""A 2-process training run saves and resumes: on one process with another layout, and on two
processes with another schedule and layout, the losses equal the uninterrupted run's; the same for
the main job (`examples/train_lm.py`) under the launcher.

The training jobs run `resume_worker.py` (under `python -m spectrax_mpmd.launch` for 2 processes) in its own
process group, killed at its time limit.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from launching import Job, job_env, launch
from mpmd_cases import RTOL

import spectrax_mpmd as mp

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "resume_worker.py")
STEPS, SAVE_AT = 4, 2


def _job(nproc: int, out, ckpt, *args: str, limit: float = 240) -> list[dict]:
    """Run the worker on `nproc` processes of 2 devices (one process: 4 devices); each process's record."""
    out.mkdir()
    worker = [WORKER, str(out), str(ckpt), "--steps", str(STEPS), *args]
    if nproc == 1:
        env = job_env()
        env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
        job = Job([sys.executable, *worker], limit, env)
    else:
        job = launch(*worker, nproc=nproc, devices=2, limit=limit, timeout=60)
    code, text, _ = job.wait()
    assert code == 0, text[-4000:]
    records = []
    for p in range(nproc):
        with open(out / f"p{p}.json") as f:
            records.append(json.load(f))
    return records


def _losses(records: list[dict]) -> dict[int, float]:
    """The losses by step, the same on every process."""
    for r in records[1:]:
        assert r["losses"] == records[0]["losses"]
    return {int(k): v for k, v in records[0]["losses"].items()}


def _written_by(step_dir, item: str, process: int) -> set[str]:
    """The arrays whose data `process` wrote into `item` of a step (orbax's per-process OCDBT files)."""
    import tensorstore as ts

    base = {"driver": "file", "path": str(step_dir / item / f"ocdbt.process_{process}")}
    keys = ts.KvStore.open({"driver": "ocdbt", "base": base}).result().list().result()
    return {k.decode().rsplit("/", 1)[0] for k in keys if not k.decode().endswith(".zarray")}


@pytest.mark.slow  # launched processes: 30-50 s on 2 shared cores
def test_two_process_run_saves_and_resumes_on_other_layouts(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _job(2, tmp_path / "a", ckpt, "--ranks", "4", "--schedule", "Std1F1B", "--save-at", str(SAVE_AT))
    full = _losses(first)
    with open(ckpt / str(SAVE_AT) / "meta" / "metadata") as f:
        meta = json.load(f)
    for item in ("params", "opt_state"):  # each array's data written once, by the process holding it
        mine, theirs = (_written_by(ckpt / str(SAVE_AT), item, p) for p in range(2))
        assert mine and theirs and not mine & theirs, (item, mine & theirs)
        assert len(mine | theirs) == len(meta[item]), item
    assert sorted(full) == list(range(STEPS))
    for r in first:
        assert r["steps"] == [SAVE_AT]
        for step in r["kinds"]:  # each leaf held here and updated, or a global array without local shards
            for kinds in step.values():
                assert kinds["other"] == 0 and kinds["unchanged"] == 0, step
                assert kinds["held"] > 0 and kinds["remote"] > 0, step
        assert r["kinds"][0]["params"]["held"] + r["kinds"][0]["params"]["remote"] == len(r["gathered"])
    # every process gathered the same parameters: the other process's leaves arrived
    np.testing.assert_array_equal(first[0]["gathered"], first[1]["gathered"])

    one = _job(1, tmp_path / "b", ckpt, "--ranks", "2", "--schedule", "GPipe", "--resume")
    two = _job(2, tmp_path / "c", ckpt, "--ranks", "2", "--schedule", "ZeroBubbleH1", "--resume")
    for resumed in (one, two):
        losses = _losses(resumed)
        assert sorted(losses) == list(range(SAVE_AT, STEPS))
        np.testing.assert_allclose([losses[s] for s in losses], [full[s] for s in losses], rtol=RTOL)
    np.testing.assert_array_equal(two[0]["gathered"], two[1]["gathered"])
    np.testing.assert_allclose(sorted(one[0]["gathered"]), sorted(two[0]["gathered"]), rtol=RTOL, atol=1e-6)


@pytest.mark.slow  # two launched jobs: about 100 s on 2 shared cores
def test_the_main_job_under_the_launcher_stops_and_resumes_with_another_schedule(tmp_path):
    """`examples/train_lm.py` (tiny) on 2 processes x 2 devices, 4 ranks: Std1F1B stops after 5 steps
    (saved at 3 and 5, each process writing its own ranks' arrays); a second job resumes from step 3
    with ZeroBubbleH1, and its steps 3 and 4 have the losses the first job had."""
    script = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "train_lm.py")
    flags = (
        "--steps 6 --batch 8 --seq 16 --d-model 32 --microbatches 4 --lr 1e-2 --sample-tokens 2 --stages 4"
    )
    base = [script, *flags.split(), "--checkpoint-dir", str(tmp_path / "ckpt")]
    runs = {
        "stopped": ["--schedule", "Std1F1B", "--save-every", "3", "--stop-after", "5"],
        "resumed": ["--schedule", "ZeroBubbleH1", "--resume", "3", "--overwrite"],
    }
    metrics = {}
    for name, extra in runs.items():
        job = launch(*base, *extra, "--out", tmp_path / name, nproc=2, devices=2, limit=240, timeout=60)
        code, text, _ = job.wait()
        assert code == 0, text[-4000:]
        with open(tmp_path / name / "metrics.json") as f:
            metrics[name] = json.load(f)
        if name == "stopped":  # both processes wrote their arrays of step 3
            assert all(_written_by(tmp_path / "ckpt" / "3", "params", p) for p in range(2))
    stopped, resumed = metrics["stopped"], metrics["resumed"]
    assert len(stopped["losses"]) == 5 and stopped["checkpoint"]["saved"] == [3, 5]
    assert resumed["first_step"] == 3 and len(resumed["losses"]) == 3
    np.testing.assert_allclose(resumed["losses"][:2], stopped["losses"][3:5], rtol=RTOL)


def test_every_process_decides_from_the_same_list_of_steps_while_one_deletes(tmp_path):
    """Process 1 lists the steps 2 s after process 0, which deletes the files of a step it chose to
    delete: both must see the list process 0 saw (else process 1 skips the collective delete and
    the job hangs in orbax's barrier, or it raises on a step that vanished)."""
    worker = os.path.join(HERE, "steps_worker.py")
    job = launch(worker, tmp_path / "ckpt", tmp_path, nproc=2, devices=1, limit=90, timeout=30)
    code, text, _ = job.wait()
    assert code == 0, text[-4000:]
    for p in range(2):
        with open(tmp_path / f"p{p}.json") as f:
            assert json.load(f) == {"later": [2], "left": [1]}, p


def test_an_array_every_process_holds_is_written_once_and_a_sharded_one_by_its_owner(tmp_path):
    """A leaf given as a NumPy array (held by both processes) is written by process 0 only; one
    sharded over process 1's two devices by process 1; both restore on one process, checked
    against their checksums."""
    A = np.arange(6, dtype=np.float32) * 3  # as owners_worker.py saves them
    B = np.arange(16, dtype=np.float32).reshape(4, 4)
    job = launch(os.path.join(HERE, "owners_worker.py"), tmp_path, nproc=2, devices=2, limit=120)
    code, text, _ = job.wait()
    assert code == 0, text[-4000:]
    written = [_written_by(tmp_path / "1", "params", p) for p in range(2)]
    assert written == [{"['a']"}, {"['b']"}]
    like = {"a": np.zeros_like(A), "b": np.zeros_like(B)}
    restored = mp.restore_checkpoint(tmp_path, like=like).params
    np.testing.assert_array_equal(restored["a"], A)
    np.testing.assert_array_equal(restored["b"], B)
