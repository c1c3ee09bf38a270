"""Faults of multi-process jobs end in an error naming the cause, in bounded time.

Two processes of one job (CPU, loopback), each case as an operator would break
it: processes that built different steps, that pass different batches after the
first call, that wait for each other on different transfers, that fail one
after the other under the launcher, that die during a checkpoint save, or that
join late. The launcher jobs start together (`jobs`); every process group is
killed at its time limit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time

import pytest
from launching import Job, job_env, launch, skip_without_sockets

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "faults_worker.py")

pytestmark = pytest.mark.slow  # launched processes: 15-40 s on 2 shared cores

LAUNCHED = {  # mode: (timeout of transfers in s, extra environment)
    "built": (20, {}),
    "inputs": (20, {}),
    "waiting": (5, {"SPECTRAX_MPMD_CHECK_INPUTS": "off"}),
    "exit3": (20, {}),
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every launcher job of this file, started at once: `{mode: (Job, output folder)}`."""
    skip_without_sockets()
    started = {}
    for mode, (timeout, extra) in LAUNCHED.items():
        out = tmp_path_factory.mktemp(mode)
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            started[mode] = (launch(WORKER, mode, out, nproc=2, devices=1, limit=180, timeout=timeout), out)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return started


def _results(jobs, mode: str) -> tuple[list[dict], str, int]:
    job, out = jobs[mode]
    code, text, _ = job.wait()
    found = [out / f"{mode}_p{p}.json" for p in (0, 1)]
    assert all(f.exists() for f in found), text[-3000:]
    return [json.loads(f.read_text()) for f in found], text, code


def test_processes_that_built_different_steps_are_refused_naming_what_differs(jobs):
    """Stage markers in other places (the edge shapes agree: the job used to train a model made
    of parts of both splits), another schedule, another microbatch count: refused on both
    processes at the first call (or at `prepare`, before any call), naming the field and each
    process's value; the same step, prepared on shapes, afterwards runs without another build
    and equals the unsplit loss."""
    results, text, code = _results(jobs, "built")
    assert code == 0, text[-3000:]
    built = "DistributedError: sxvalue_and_grad: the processes of the job built different steps: "
    for mine in results:
        assert mine["markers"].startswith(built + "stage 0's boundary differs (process 0: in [arg 0"), mine
        assert "stage markers (sxstage_iter) in the same places" in mine["markers"]
        assert mine["schedule"].startswith(
            built + "the schedule differs (process 0: Std1F1B(microbatches=2, virtual_stages=1); "
            "process 1: GPipe(microbatches=2, virtual_stages=1))"
        ), mine
        assert mine["micro"].startswith(
            built + "the microbatch count differs (process 0: 2; process 1: 4)"
        ), mine
        assert mine["prepare schedule"].startswith(built + "the schedule differs (process 0: Std1F1B"), mine
        loss, reference = mine["same"]
        assert loss == pytest.approx(reference, rel=1e-5)
        assert mine["prepared"] > 0 and mine["builds"] == 1, mine  # prepared once, then only run


def test_different_batches_are_refused_at_the_call_they_start(jobs):
    """With the default check, process 1's batch values changing at the third call, and the
    processes switching to different shapes both ran before, are refused at that call, naming
    the argument; the job goes on with equal batches."""
    results, text, code = _results(jobs, "inputs")
    assert code == 0, text[-3000:]
    passed = (
        "DistributedError: sxvalue_and_grad: the processes of the job passed different arguments to call "
    )
    for mine in results:
        assert mine["values later"].startswith(
            passed + "3: argument 1 ('x') (float32[8, 8]) has different values (process 0 vs process 1)"
        ), mine
        assert mine["shapes later"].startswith(
            passed + "5: the shape or dtype of argument 1 ('x') differs (process 0: float32[8, 8], "
            "process 1: float32[16, 8])"
        ), mine
        for case in ("same 0", "same 1", "16 rows", "same again"):
            loss, reference = mine[case]
            assert loss == pytest.approx(reference, rel=1e-5), case


def test_a_live_peer_waiting_on_another_transfer_is_named_as_such(jobs):
    """Unchecked, the processes run different plans (8 rows on one, 16 on the other): each times
    out and names, for both ranks, the cell it waits in and the transfer that cell expects (rank 0
    its first backward, for the cotangent; rank 1 its first forward, for the activation), and says
    the other is alive and waiting instead of calling it dead."""
    results, text, code = _results(jobs, "waiting")
    assert code == 1, text[-3000:]
    waits = [
        "the cotangent of edge 0 (stage 1 on rank 1 -> stage 0 on rank 0), microbatch 0, for cell 0B0 of rank 0",
        "the activation of edge 0 (stage 0 on rank 0 -> stage 1 on rank 1), microbatch 0, for cell 1F0 of rank 1",
    ]
    for me, mine in enumerate(results):
        other = 1 - me
        assert mine["switched"].startswith(f"TransferTimeoutError: process {me}: {waits[me]} did not arrive"), mine
        assert f"process {other} is alive but waits as well, in its call 3 for {waits[other]} (" in mine["switched"]
        assert "the processes are not running the same step" in mine["switched"]
        assert "may have died" not in mine["switched"]


def test_the_launcher_names_the_process_that_failed_first(jobs):
    """Process 1 leaves with code 3; process 0 then fails or is stopped: the launcher names
    process 1 first, with its code, and exits with it."""
    job, _ = jobs["exit3"]
    code, text, _ = job.wait()
    assert code == 3, text[-3000:]
    assert "spectrax_mpmd.launch: rank 1 (pid " in text and ") failed first: it exited with code 3" in text, (
        text[-3000:]
    )


def _by_hand(argv: list[str], timeout: float, limit: float) -> list[Job]:
    """Processes 0 and 1 of a job started without the launcher (which would stop the job itself
    when one fails), each killed at `limit` s."""
    skip_without_sockets()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2"}
    env.update(SPECTRAX_MPMD_TIMEOUT=str(timeout), PYTHONUNBUFFERED="1")
    return [Job([sys.executable, *argv], limit, job_env(JAX_PROCESS_ID=str(p), **env)) for p in (0, 1)]


def test_a_peer_killed_during_a_checkpoint_save_is_reported_at_once(tmp_path):
    """Process 1 is killed while its part of step 2 is written in the background: process 0,
    saving step 2 or waiting for it, ends within seconds with a `CheckpointError` naming process 1
    and the step (it used to wait about 50 s in orbax's barrier, then end in orbax's or JAX's error);
    step 1 stays committed."""
    survivor, victim = _by_hand([WORKER, "save_death", str(tmp_path)], timeout=30, limit=150)
    code, text, _ = survivor.wait()
    ended = time.time()
    victim.wait()
    assert code == 1, text[-3000:]
    assert (
        "spectrax_mpmd.errors.CheckpointError: process 0: process 1 ended without finishing (killed, "
        "crashed, or ended by an error) during the checkpoint save of step 2" in text
    ), text[-3000:]
    since = float(re.search(r"saving step 2 since ([\d.]+)", text).group(1))
    assert ended - since < 20, ended - since  # JAX's heartbeat would take 60 s (twice the timeout)
    assert json.loads((tmp_path / "save_death_p0.json").read_text()) == {"committed": [1]}


def test_a_peer_ending_between_steps_is_named_at_once(tmp_path):
    """Process 1 leaves (code 3) after its first step; process 0's next call, whose arguments the
    default check compares first, names process 1 as ended within seconds instead of waiting the
    timeout (20 s) for its side of the comparison."""
    survivor, leaver = _by_hand([WORKER, "exit3", str(tmp_path)], timeout=20, limit=150)
    code, text, _ = survivor.wait()
    assert leaver.wait()[0] == 3
    (second,) = [json.loads((tmp_path / "exit3_p0.json").read_text())["second"]]
    assert second.startswith(
        "PeerLostError: sxvalue_and_grad: comparing the arguments of call 2 with the other processes: "
        "process 0: process 1 ended without finishing"
    ), second
    started = float(re.search(r"second call at ([\d.]+)", text).group(1))
    assert float(re.search(r"refused at ([\d.]+)", text).group(1)) - started < 10


def test_a_stalled_peer_is_named_at_the_timeout(tmp_path):
    """Process 1 sleeps before its second call: process 0's comparison of that call's arguments
    ends at the timeout (4 s), naming process 1 as possibly dead or stalled."""
    waiting, sleeper = _by_hand([WORKER, "stall", str(tmp_path)], timeout=4, limit=150)
    code, text, _ = waiting.wait()
    os.killpg(sleeper.proc.pid, signal.SIGKILL)
    sleeper.proc.wait()
    second = json.loads((tmp_path / "stall_p0.json").read_text())["second"]
    assert second.startswith(
        "DistributedError: sxvalue_and_grad: comparing the arguments of call 2 with the other processes: "
        "process 0: process 1 did not reach the exchange "
    ), second
    assert "within 4 s; it may have died or stalled" in second, second
    started = float(re.search(r"second call at ([\d.]+)", text).group(1))
    assert 4 <= float(re.search(r"refused at ([\d.]+)", text).group(1)) - started < 12


LATE = """
import os, sys, time
if os.environ["JAX_PROCESS_ID"] == "1":
    time.sleep(12)
import spectrax_mpmd as mp
mp.initialize()
"""


def test_a_process_joining_late_ends_the_waiting_one_with_a_clear_error(tmp_path):
    """Process 1 starts initialize 12 s late with a 4 s timeout: process 0 (the coordinator) ends
    with a `DistributedError` saying that not every process joined (it used to be aborted by JAX
    with a message blaming a task that died); process 1 finds no coordinator and says so."""
    script = tmp_path / "late.py"
    script.write_text(LATE)
    first, late = _by_hand([str(script)], timeout=4, limit=90)
    code, text, seconds = first.wait()
    assert code == 1, text[-3000:]
    assert (
        "spectrax_mpmd.errors.DistributedError: process 0: not all 2 processes of the job joined within 4 s"
        in text
    )
    assert "task died" not in text.replace("with a message that a task died", "")
    code, text, _ = late.wait()
    assert code == 1 and "DistributedError: the coordinator at 127.0.0.1:" in text, text[-3000:]
