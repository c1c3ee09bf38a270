"""Start N local processes of one script as a `jax.distributed` job (development and tests).

    python -m spectrax_mpmd.launch --nproc N [--devices-per-proc K] [--timeout S]
        [--transport transfer|ppermute] script.py args...

Each process gets `JAX_COORDINATOR_ADDRESS` (loopback, a free port),
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` and, with `--devices-per-proc`, K host
devices (`--xla_force_host_platform_device_count`); the script calls
`spectrax_mpmd.initialize()`. Output lines are forwarded with a `[rank i]`
prefix (i: the process index). When a process fails, the launcher names the
one that failed first and how (its exit code or signal; the others usually fail
because of it), stops every other process and exits with that process's code
(128 + signal for a killed one); it exits 0 when all succeed.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from ._env import TIMEOUT_ENV, TRANSPORT_ENV, TRANSPORTS

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


_PORT_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PORT = 10000


def _free_port() -> int:
    """A free loopback port for a job's coordinator. Where the system says which ports it hands
    out on its own (to outgoing connections, to servers bound to port 0), one below them: between
    this check and the coordinator binding it, no other process of the job (or of another job
    started at the same time) can be given it. Elsewhere, one the system hands out."""
    first = _first_ephemeral_port()
    candidates = random.Random().sample(range(_LOWEST_PORT, first), 64) if first > _LOWEST_PORT + 64 else []
    for port in [*candidates, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free loopback port")


def _first_ephemeral_port() -> int:
    """The lowest port the system hands out on its own (0 where it does not say: not Linux)."""
    try:
        with open(_PORT_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _child_env(args, rank: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(args.nproc),
        JAX_PROCESS_ID=str(rank),
        PYTHONUNBUFFERED="1",
    )
    if args.timeout is not None:
        env[TIMEOUT_ENV] = str(args.timeout)
    if args.transport is not None:
        env[TRANSPORT_ENV] = args.transport
    if args.devices_per_proc is not None:
        flags = _DEVICE_FLAG.sub("", env.get("XLA_FLAGS", "")).strip()
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices_per_proc}".strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _forward(rank: int, stream, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(f"[rank {rank}] " + line.decode(errors="replace"))
            out.flush()
    stream.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _report(procs: list, ended: dict, lock: threading.Lock, stopping: bool) -> int:
    """Name the process that failed first (by the time it ended: the others usually fail because
    of it) and the others that failed after it, and return the launcher's exit code: the first
    failure's code, 128 + signal if it was killed."""
    failed = sorted(
        (
            (ended.get(r, float("inf")), r, p.returncode)
            for r, p in enumerate(procs)
            if p.returncode not in (None, 0)
        ),
    )
    first_at, first, rc = failed[0]
    text = f"rank {first} (pid {procs[first].pid}) failed first: it {_describe(rc)}"
    later = [f"rank {r} {_describe(code)} {at - first_at:.2f} s later" for at, r, code in failed[1:]]
    if later:
        text += f"; then {', '.join(later)}"
    alive = sum(p.returncode is None for p in procs)
    tail = f"; stopping the other {alive} process(es)" if stopping and alive else ""
    with lock:
        sys.stderr.write(f"spectrax_mpmd.launch: {text}{tail}.\n")
        sys.stderr.flush()
    return 128 - rc if rc < 0 else rc


def _watch_end(rank: int, proc, ended: dict) -> None:
    """Record when process `rank` ends (a thread per process: the order of failures is known to
    the thread switch, not to the launcher's polling interval)."""
    proc.wait()
    ended[rank] = time.monotonic()


def _stop(procs: list) -> None:
    """SIGTERM, then SIGKILL after a short grace (JAX's preemption handler may swallow SIGTERM)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launch(argv: list[str] | None = None) -> int:
    """Run the launcher on `argv` (default `sys.argv[1:]`); returns its exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m spectrax_mpmd.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes to start")
    parser.add_argument("--devices-per-proc", type=int, default=None, help="CPU devices per process")
    parser.add_argument("--timeout", type=float, default=None, help="cross-process transfer timeout, s")
    parser.add_argument("--transport", choices=TRANSPORTS, default=None, help="cross-process transport")
    parser.add_argument("script", help="the Python script every process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        parser.error(f"--devices-per-proc must be at least 1, got {args.devices_per_proc}")
    port, lock = _free_port(), threading.Lock()
    procs, readers, ended = [], [], {}
    for rank in range(args.nproc):
        p = subprocess.Popen(
            [sys.executable, args.script, *args.args],
            env=_child_env(args, rank, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        procs.append(p)
        t = threading.Thread(target=_forward, args=(rank, p.stdout, sys.stdout, lock), daemon=True)
        t.start()
        readers.append(t)
        threading.Thread(target=_watch_end, args=(rank, p, ended), daemon=True).start()
    code = 0
    try:
        while [p.poll() for p in procs].count(None):  # poll every process, not just the first alive
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(0.05)  # the ending threads record the times of failures that came together
                code = _report(procs, ended, lock, stopping=True)
                _stop(procs)
                break
            time.sleep(0.05)
        else:
            if any(p.returncode != 0 for p in procs):
                time.sleep(0.05)
                code = _report(procs, ended, lock, stopping=False)
    except KeyboardInterrupt:
        _stop(procs)
        code = 130
    for t in readers:
        t.join(timeout=2.0)
    _remove_claims(port, args.nproc)
    return code


def _remove_claims(port: int, nproc: int) -> None:
    """Remove the id lock files the job's processes left (a killed process skips its own cleanup);
    every process has ended, so none is held."""
    from ._comm import claim_path

    for rank in range(nproc):
        try:
            os.unlink(claim_path("127.0.0.1", port, rank))
        except FileNotFoundError:
            pass


def _interrupted(*_) -> None:
    """SIGTERM to the launcher: stop the processes as for Ctrl-C."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    sys.exit(launch())
