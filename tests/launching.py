"""Starting the multi-process tests' jobs: `python -m spectrax_mpmd.launch` (or any command) in its
own process group, with the suite's environment, killed with its whole group at its time limit so
that a hang fails the test instead of the suite. The processes of a job coordinate through a TCP
socket on the loopback: on a machine that allows none, every such test is skipped, saying why."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

NO_SOCKETS = (
    "this machine allows no TCP socket, not even on the loopback (binding 127.0.0.1 failed), and the "
    "processes of a jax.distributed job coordinate through one"
)


@functools.cache
def sockets_available() -> bool:
    """Whether this process may bind a TCP socket on the loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
    except OSError:
        return False
    return True


def skip_without_sockets() -> None:
    """Skip the calling test, saying why, where no socket can be opened (`NO_SOCKETS`)."""
    if not sockets_available():
        pytest.skip(NO_SOCKETS)


def job_env(**extra: str) -> dict:
    """This environment for a job: CPU, the suite's compiler flags (see conftest) without its device
    count (the launcher sets each process's), and this interpreter's import path; then `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_backend_optimization_level=0",
        PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]),
        **extra,
    )
    return env


class Job:
    """A command started in its own process group; `wait` kills the group at the time limit
    (counted from the start, so a test may compute its references while the job runs)."""

    def __init__(self, cmd: list[str], limit: float, env: dict | None = None):
        self.cmd, self.limit, self.start = cmd, limit, time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            env=env or job_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self) -> tuple[int, str, float]:
        """(exit code, output (stdout and stderr), seconds since the start); fails the test with the
        output's end if the job runs past its limit."""
        try:
            out, _ = self.proc.communicate(timeout=max(1.0, self.limit - (time.monotonic() - self.start)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, _ = self.proc.communicate()
            pytest.fail(f"{self.cmd} ran past {self.limit} s:\n{out.decode(errors='replace')[-3000:]}")
        return self.proc.returncode, out.decode(errors="replace"), time.monotonic() - self.start


def launch(
    script: str,
    *args: str,
    nproc: int,
    devices: int,
    limit: float,
    timeout: float | None = None,
    transport: str | None = None,
) -> Job:
    """Start `python -m spectrax_mpmd.launch` running `script args` on `nproc` processes of `devices`
    CPU devices each, as a `Job` killed at `limit` s; `timeout` (of cross-process transfers, s) and
    `transport` are the launcher's defaults when None. Skips the test where no socket can be
    opened (`skip_without_sockets`)."""
    skip_without_sockets()
    cmd = [sys.executable, "-m", "spectrax_mpmd.launch", "--nproc", str(nproc), "--devices-per-proc"]
    cmd.append(str(devices))
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    if transport is not None:
        cmd += ["--transport", transport]
    return Job([*cmd, str(script), *map(str, args)], limit)
