"""Multi-process MPMD on JAX's distributed runtime (CPU, loopback): every process runs only its
own ranks; results equal one process's; failures end the job with a clear error in bounded time.

Each test launches `multihost_worker.py` with `python -m spectrax_mpmd.launch` (or starts
processes by hand for the setup errors); every process group is killed at its time limit.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import multihost_worker as worker
import numpy as np
import pytest
from launching import Job, job_env, launch, skip_without_sockets
from mpmd_cases import RTOL, hetero_loss

import spectrax_mpmd as mp
from spectrax_mpmd.launch import _free_port as free_port

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "multihost_worker.py")
TRANSPORTS = ("transfer", "ppermute")


def _launch(
    nproc: int,
    devices: int,
    mode: str,
    out_dir,
    limit: float,
    timeout: float = 20,
    transport: str = "transfer",
) -> Job:
    """Start `multihost_worker.py MODE` under the launcher (the tests compute their references
    while it runs). `schedules` and `adamw` run every case through each transport themselves;
    `transport` is the launcher's choice for the other modes."""
    return launch(
        WORKER, mode, out_dir, nproc=nproc, devices=devices, limit=limit, timeout=timeout, transport=transport
    )


def _merged(out_dir, case: str, nproc: int) -> dict:
    """Every process's share of `case`; the loss must be the same on every process, and every
    other array must come from exactly one process (its owner)."""
    files = sorted(glob.glob(os.path.join(out_dir, f"{case}_p*.npz")))
    assert len(files) == nproc, files
    merged: dict = {}
    for f in files:
        with np.load(f) as z:
            for k in z.files:
                if k in ("loss", "losses", "error") and k in merged:
                    np.testing.assert_array_equal(z[k], merged[k])
                    continue
                assert k not in merged, f"{case}: {k} returned by two processes"
                merged[k] = z[k]
    return merged


def _check(merged: dict, loss, grads) -> None:
    np.testing.assert_allclose(merged["loss"], loss, rtol=RTOL, atol=1e-6)
    leaves = jax.tree.leaves(grads)
    assert sorted(merged) == sorted(["loss", *(f"g{k}" for k in range(len(leaves)))])
    for k, g in enumerate(leaves):
        np.testing.assert_allclose(merged[f"g{k}"], g, rtol=RTOL, atol=1e-6)


@pytest.mark.slow  # launched processes: 30-50 s on 2 shared cores
def test_two_processes_two_devices_every_schedule(tmp_path):
    """2 processes x 2 devices, 4 ranks: GPipe, Std1F1B, ZeroBubbleH1, InterleavedH1 (v=2), a
    tied parameter whose gradient is summed across processes, then a model on 2 ranks of 2
    devices each whose activations are split over them, and an `sxjit` forward
    all equal the unsplit reference on one device (which single-process runs equal at this
    tolerance), through each transport."""
    job = _launch(2, 2, "schedules", tmp_path, limit=200)
    grad = jax.jit(jax.value_and_grad(hetero_loss))
    refs = {name: grad(*worker.model(4 * schedule.virtual_stages)) for name, schedule in worker.SCHEDULES}
    params, batch = worker.model(4)
    refs["tied"] = jax.jit(jax.value_and_grad(worker._tied_loss))(worker._tied_params(), batch)
    refs["sharded"] = jax.jit(jax.value_and_grad(worker.sharded_loss))(worker._tied_params(), batch)
    y = jax.jit(worker._forward)(params, batch[0])
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in TRANSPORTS:
        for name, (loss, grads) in refs.items():
            _check(_merged(tmp_path, f"{name}-{transport}", 2), loss, grads)
        np.testing.assert_allclose(_merged(tmp_path, f"forward-{transport}", 2)["y"], y, rtol=RTOL, atol=1e-6)
    error = str(_merged(tmp_path, "profile", 2)["error"])
    assert error.startswith("sxvalue_and_grad.profile runs the plan step by step in one process")


@pytest.mark.slow  # launched processes: 30-50 s on 2 shared cores
def test_four_processes_std1f1b_and_adamw_curve(tmp_path):
    """4 processes x 1 device: one Std1F1B step, an `mp.Runner` step and an eager `spx.run` step
    equal their references (the last: the same call in one process),
    and a 10-step AdamW loop (global-norm clipping across processes) gives the loss curve of
    the single-process run, through each transport. The runtime's key-value exchange gives what
    its public fallback (a device collective) gives; processes that chose different transports,
    or a mesh that leaves processes without a rank, are refused by every process."""
    job = _launch(4, 1, "adamw", tmp_path, limit=200)
    ref = jax.jit(jax.value_and_grad(hetero_loss))(*worker.model(4))
    params, _, x, y = worker._mlp_case()
    runner_ref = jax.value_and_grad(lambda p: worker._mse(worker._mlp_forward(p, None, x), y))(params)
    eager_ref = worker.eager_run()  # the same eager call in this one process, its ranks all local
    single_step = mp.sxvalue_and_grad(
        hetero_loss, mesh=worker._mesh(4), schedule=worker.S.Std1F1B(microbatches=4)
    )
    single = worker.adamw_losses(single_step, *worker.model(4))
    assert single[-1] < single[0]
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in TRANSPORTS:
        _check(_merged(tmp_path, f"Std1F1B-{transport}", 4), *ref)
        _check(_merged(tmp_path, f"runner-{transport}", 4), *runner_ref)  # mp.Runner, the functional `mp.run`
        _check(_merged(tmp_path, f"eager-{transport}", 4), *eager_ref)  # the eager API's `spx.run`
        np.testing.assert_allclose(_merged(tmp_path, f"adamw-{transport}", 4)["losses"], single, rtol=RTOL)
    # a mesh over processes 0 and 1 only: every process refuses it, naming the idle ones
    error = str(_merged(tmp_path, "idle", 4)["error"])
    assert error.startswith(
        "the job has 4 processes but the mesh's 2 pipeline ranks live in processes [0, 1]"
    )
    assert "processes [2, 3] hold no rank" in error
    # process 1 chose the other transport: every process refuses, naming each one's choice
    choices = "process 0: transfer, process 1: ppermute, process 2: transfer, process 3: transfer"
    error = str(_merged(tmp_path, "mismatch", 4)["error"])
    assert error.startswith(f"the processes chose different transports ({choices})")
    assert "set SPECTRAX_MPMD_TRANSPORT the same on every process" in error
    # the exchange through the coordination service equals its public fallback, on every process
    expected = [f"process {p}" for p in range(4)]
    for p in range(4):
        shares = np.load(os.path.join(tmp_path, f"exchange_p{p}.npz"))
        assert list(shares["store"]) == expected and list(shares["collective"]) == expected


def test_lost_processes_end_the_job(tmp_path, monkeypatch):
    """Three jobs at once. In one, process 1 is killed in the middle of a step: the launcher
    names it, stops the other process and exits non-zero. In the others, one per transport,
    process 0 stops answering: process 1's step raises after the timeout, naming the ranks, the
    edge and the microbatch it waited for, and the launcher names process 1 and stops both.
    (Arguments are compared at first calls only, so that the transports' own deadlines act.)"""
    monkeypatch.setenv("SPECTRAX_MPMD_CHECK_INPUTS", "first")
    jobs = {}
    for mode, transport, timeout in (("die", "ppermute", 5), *(("hang", t, 2) for t in TRANSPORTS)):
        out = tmp_path / f"{mode}-{transport}"
        out.mkdir()
        jobs[mode, transport] = _launch(2, 1, mode, out, limit=120, timeout=timeout, transport=transport)
    code, out, _ = jobs["die", "ppermute"].wait()
    assert code != 0, out[-3000:]
    assert "killing myself mid-step" in out
    assert "spectrax_mpmd.launch: rank 1" in out and "killed by signal SIGKILL" in out, out[-3000:]
    for transport in TRANSPORTS:
        code, out, seconds = jobs["hang", transport].wait()
        assert code != 0
        assert "TransferTimeoutError: process 1:" in out, out[-3000:]
        assert "edge 0 (stage 0 on rank 0 -> stage 1 on rank 1), microbatch 0" in out, out[-3000:]
        assert "did not arrive within 2 s" in out
        assert "spectrax_mpmd.launch: rank 1" in out and "exited with code 1" in out
        assert seconds < 100


def _free_port() -> int:
    skip_without_sockets()
    return free_port()


def test_a_coordinator_port_is_never_one_the_system_hands_out():
    """The launcher's port for a coordinator lies below the ports the system gives sockets on its
    own, so no process started meanwhile (another job's, say) can be given it first."""
    from spectrax_mpmd.launch import _first_ephemeral_port

    first = _first_ephemeral_port()
    if first <= 10064:
        pytest.skip("this system does not say which ports it hands out on its own")
    ports = {_free_port() for _ in range(20)}
    assert all(port < first for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _claimed(path: str) -> bool:
    """Whether some process holds the lock file `path`."""
    import fcntl

    if not os.path.exists(path):
        return False
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_setup_errors_are_clear_and_fast(monkeypatch):
    """A second process 0, a second process 1 on the same host and an unreachable coordinator
    are clear errors within seconds, raised before JAX's own initialisation (which would abort
    the job or wait out its registration timeout)."""
    from spectrax_mpmd._comm.distributed import claim_path

    monkeypatch.delenv("SPECTRAX_MPMD_TIMEOUT", raising=False)
    port, dead_port = _free_port(), _free_port()
    code = "import spectrax_mpmd as mp; mp.initialize(timeout=30)"
    members = [  # processes 0 and 1 of a 3-process job, waiting for process 2
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=job_env(
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="3", JAX_PROCESS_ID=str(p)
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for p in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0 or not _claimed(
            claim_path("127.0.0.1", port, 1)
        ):
            assert time.monotonic() < deadline and all(m.poll() is None for m in members), (
                "the job never formed"
            )
            time.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(mp.DistributedError, match="another process already claims process id 0"):
            mp.initialize(f"127.0.0.1:{port}", 3, 0)
        holder = rf"pid {members[1].pid}"
        with pytest.raises(
            mp.DistributedError,
            match=rf"process id 1 of the job at 127.0.0.1:{port} is already claimed by another process on this host \({holder}\)",
        ):
            mp.initialize(f"127.0.0.1:{port}", 3, 1)
        with pytest.raises(mp.DistributedError, match=f"127.0.0.1:{dead_port} is unreachable after 1 s"):
            mp.initialize(f"127.0.0.1:{dead_port}", 2, 1, timeout=1)
        assert not _claimed(claim_path("127.0.0.1", dead_port, 1))  # a failed join gives its id back
        assert time.monotonic() - start < 10
    finally:
        for p, m in enumerate(members):
            os.killpg(m.pid, signal.SIGKILL)
            m.wait()
            if os.path.exists(claim_path("127.0.0.1", port, p)):  # a killed process leaves its file
                os.unlink(claim_path("127.0.0.1", port, p))


def test_initialize_checks_arguments_before_joining():
    """Argument errors are raised at once, before any connection is tried."""
    with pytest.raises(mp.DistributedError, match=r"process_id 5 is not in \[0, 2\)"):
        mp.initialize("127.0.0.1:1", 2, 5)
    with pytest.raises(mp.DistributedError, match="num_processes must be at least 1"):
        mp.initialize("127.0.0.1:1", 0, 0)
    with pytest.raises(mp.DistributedError, match="expected 'host:port'"):
        mp.initialize("nowhere", 2, 1)
    with pytest.raises(mp.DistributedError, match="timeout must be a positive"):
        mp.initialize("127.0.0.1:1", 2, 1, timeout=0)


def test_zero_size_arrays_cross_processes(tmp_path):
    """An edge holding a zero-size array next to a full one, its cotangent, and a zero-size
    tied parameter's gradient (a transfer of nothing but empty arrays) cross processes through
    each transport; loss and gradients equal the unsplit reference."""
    job = _launch(2, 1, "empty", tmp_path, limit=150, timeout=10)
    ref = jax.value_and_grad(worker.empty_loss)(*worker.empty_case())
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in TRANSPORTS:
        _check(_merged(tmp_path, f"empty-{transport}", 2), *ref)


def test_processes_must_pass_the_same_arguments(tmp_path):
    """Every process refuses a call where process 1 passed other values, shapes, parameters or
    argument structure than process 0 (through each transport, before any transfer), naming the
    argument; the same arguments then run. An `sxjit` forward is checked too, and with
    SPECTRAX_MPMD_CHECK_INPUTS=always a later call of a signature that already ran."""
    job = _launch(2, 1, "inputs", tmp_path, limit=200, timeout=10)
    same = jax.jit(jax.value_and_grad(hetero_loss))(*worker.model(2))
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    refused = "sxvalue_and_grad: the processes of the job passed different arguments to call {}: "
    expected = {
        "values": "argument 1 ('batch')[0] (int32[16, 3]) has different values (process 0 vs process 1)",
        "shapes": "the shape or dtype of argument 1 ('batch')[0] differs (process 0: int32[16, 3], "
        "process 1: int32[8, 3])",
        "params": "argument 0 ('params')['head'] (float32[8, 5]) has different values "
        "(process 0 vs process 1)",
        "tree": "the structure of argument 1 ('batch') differs (process 0: PyTreeDef((*, *)), "
        "process 1: PyTreeDef([*, *]))",
    }
    for transport in TRANSPORTS:
        for call, (case, difference) in enumerate(expected.items(), 1):  # calls of one step
            error = str(_merged(tmp_path, f"{case}-{transport}", 2)["error"])  # the same on every process
            assert error.startswith(
                refused.format(call) + difference + ". Every process must pass the same arguments"
            )
        _check(_merged(tmp_path, f"same-{transport}", 2), *same)
    error = str(_merged(tmp_path, "sxjit", 2)["error"])
    assert error.startswith(
        "sxjit: the processes of the job passed different arguments to call 1: argument 1 ('tokens') "
    )
    error = str(_merged(tmp_path, "always", 2)["error"])
    assert error.startswith(refused.format(2) + "argument 1 ('batch')[1] (int32[16]) has different values")


EXITED = r"spectrax_mpmd\.launch: rank {rank} \(pid \d+\) failed first: it exited with code 1"


def test_a_process_that_stops_issuing_steps_ends_the_job(tmp_path, monkeypatch):
    """Process 1 makes fewer calls than process 0, or raises between two calls: through each
    transport process 0's next call ends within the timeout with `TransferTimeoutError` (with
    `ppermute` its issue blocks until the peer issues its side; the limit still applies), and a
    process ending by an uncaught error exits at once instead of waiting for its peers. A process
    that made fewer calls is named as waiting at its exit. (Arguments are compared at first calls
    only, so that the transports' own deadlines act; the default check names the same cause.)"""
    monkeypatch.setenv("SPECTRAX_MPMD_CHECK_INPUTS", "first")
    jobs = {}
    for mode in ("fewer", "raise"):
        for transport in TRANSPORTS:
            out = tmp_path / f"{mode}-{transport}"
            out.mkdir()
            jobs[mode, transport] = _launch(2, 1, mode, out, limit=150, timeout=3, transport=transport)
    for (mode, transport), job in jobs.items():
        code, out, seconds = job.wait()
        assert code != 0, out[-3000:]
        if mode == "fewer":
            assert "TransferTimeoutError: process 0: the " in out, out[-3000:]
            assert re.search(r"microbatch 0, for cell \d[FBI]\d+ of rank \d did not arrive within 3 s", out), out[-3000:]
            assert "process 1 is alive but waits as well, at its exit, after 2 calls" in out, out[-3000:]
            assert re.search(EXITED.format(rank=0), out), out[-3000:]
        else:
            assert "ValueError: process 1 fails between steps" in out, out[-3000:]
            assert re.search(EXITED.format(rank=1), out), out[-3000:]
        assert seconds < 120, (mode, transport, seconds)


def test_a_process_that_never_joined_the_job_is_refused(tmp_path):
    """Under the launcher (which sets JAX_NUM_PROCESSES=2), a script that never calls
    `mp.initialize()` is refused at `create_mesh` and at the first call of a function on a
    plain `jax.sharding.Mesh`, instead of running the whole job alone in every process."""
    code, out, _ = _launch(2, 2, "noinit", tmp_path, limit=120).wait()
    assert code == 0, out[-3000:]
    joined = "$JAX_NUM_PROCESSES=2 and $JAX_PROCESS_ID={} make this process one of a job of 2 processes"
    for p in range(2):
        for case, where in (("mesh", "create_mesh"), ("build", "sxjit")):
            error = str(np.load(os.path.join(tmp_path, f"{case}_p{p}.npz"))["error"])
            assert error.startswith(f"{where}: " + joined.format(p)), error
            assert "Call spectrax_mpmd.initialize() at the start of the script" in error
