"""Joining a `jax.distributed` job with bounded waits and clear errors.

`initialize` is `jax.distributed.initialize` with the checks JAX leaves to a
crash: it reads the launcher's environment (`JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), validates the process id against the
world size, refuses a second process with the same id on one host (a lock
file per id) and a second process 0 anywhere (the coordinator's port is taken),
waits at most `timeout` seconds for the coordinator to be reachable, and sets
JAX's own registration, heartbeat and shutdown timeouts from `timeout` so a
lost peer ends the job instead of hanging it. Without any address or
environment, JAX's cluster detection (SLURM, Open MPI, Kubernetes, Cloud TPU)
fills the arguments in; with no cluster either, `initialize` does nothing and
the script runs as one process, so one script serves every case.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import re
import socket
import sys
import tempfile
import threading
import time

import jax

from .._env import (
    ADDRESS_ENV,
    ID_ENV,
    TIMEOUT_ENV,
    TRANSPORT_ENV,
    TRANSPORTS,
    WORLD_ENV,
    configured_timeout,
    configured_transport,
    coordinator_from_env,
    int_env,
    job_size_from_env,
)
from .._trace.jax_private import private
from ..errors import DistributedError
from .deadline import leave


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise DistributedError(
            f"coordinator_address {address!r}: expected 'host:port', e.g. '10.0.0.1:1234' "
            f"(or set ${ADDRESS_ENV})."
        )
    return host.strip("[]"), int(port)


def _check_port_free(host: str, port: int) -> None:
    """Process 0 serves the coordinator: its port must not be taken (by a second process 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        taken = probe.connect_ex((host, port)) == 0
    if taken:
        raise DistributedError(
            f"process 0 serves the coordinator at {host}:{port}, but something already listens there: "
            "another process already claims process id 0 (or another program holds the port). Give "
            "every process its own id in [0, num_processes) and a free coordinator port."
        )


def claim_path(host: str, port: int, pid: int) -> str:
    """The lock file by which a process on this host claims process id `pid` of the job
    coordinated at `host:port`."""
    name = re.sub(r"[^A-Za-z0-9.]", "_", f"{host}_{port}")
    return os.path.join(tempfile.gettempdir(), f"spectrax_mpmd-{name}-process{pid}.lock")


def _claim(host: str, port: int, pid: int):
    """Hold this host's lock on process id `pid` of the job; a second process claiming the
    same id on this host is a clear error instead of JAX's abort of the whole job (duplicates
    on different hosts cannot be seen from here). Returns the open lock file: the lock lasts
    until `_release` or the end of the process."""
    path = claim_path(host, port, pid)
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise DistributedError(
            f"process id {pid} of the job at {host}:{port} is already claimed by another process on "
            f"this host (pid {holder}). Give every process its own id in [0, num_processes) "
            f"(${ID_ENV} or process_id=)."
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    return lock


def _release(lock) -> None:
    """Give a claimed id back: remove its lock file, then drop the lock."""
    try:
        os.unlink(lock.name)
    except OSError:
        pass
    lock.close()


def _wait_reachable(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError as err:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"the coordinator at {host}:{port} is unreachable after {timeout:g} s ({err}). Start "
                    "process 0 first (it serves the coordinator; it also gives up when the others do not "
                    "join within the timeout), and check the address, the port and the firewall "
                    f"(${ADDRESS_ENV} or coordinator_address=)."
                ) from None
            time.sleep(0.1)


def _cluster_detected() -> bool:
    """Whether JAX's cluster detection (SLURM, Open MPI, ...) recognises this environment.
    Feature-detected private API; where it is missing, assume a cluster and let JAX decide."""
    kinds = getattr(private("jax._src.clusters.ClusterEnv"), "_cluster_types", None)
    if kinds is None:
        return True
    return any(not k.opt_in_only_method and k.is_env_present() for k in kinds)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: float | None = None,
    transport: str | None = None,
    local_device_ids=None,
) -> bool:
    """Join the `jax.distributed` job this process belongs to, failing fast on bad setups.

    Args:
      coordinator_address: `host:port` of process 0 (default `$JAX_COORDINATOR_ADDRESS`).
      num_processes: the world size (default `$JAX_NUM_PROCESSES`).
      process_id: this process's index in `[0, num_processes)` (default `$JAX_PROCESS_ID`).
      timeout: seconds to wait for the coordinator, and for any cross-process transfer of
        a pipelined step before it raises (default `$SPECTRAX_MPMD_TIMEOUT`, else 30). JAX's
        heartbeat is set to twice this, so a lost process ends the job within that time.
      transport: how pipelined steps move buffers between processes: `"transfer"` (default:
        one-sided pulls through `jax.experimental.transfer`) or `"ppermute"` (two-sided
        `lax.ppermute` programs, the collective library's path). Default
        `$SPECTRAX_MPMD_TRANSPORT`; every process of a job must choose the same.
      local_device_ids: passed to `jax.distributed.initialize` (which devices this process uses).

    With none of the three set (arguments or environment), JAX's cluster detection
    (SLURM, Open MPI, ...) supplies them; without a cluster either, nothing happens and
    the script runs as one process. Returns whether this process joined a job.
    """
    address = coordinator_address or coordinator_from_env()
    world = num_processes if num_processes is not None else int_env(WORLD_ENV)
    pid = process_id if process_id is not None else int_env(ID_ENV)
    if timeout is not None:
        if not timeout > 0:
            raise DistributedError(
                f"initialize: timeout must be a positive number of seconds, got {timeout!r}."
            )
        os.environ[TIMEOUT_ENV] = str(float(timeout))  # read by this process's transports
    if transport is not None:
        if transport not in TRANSPORTS:
            raise DistributedError(
                f"initialize: transport must be one of {', '.join(map(repr, TRANSPORTS))}, got {transport!r}."
            )
        os.environ[TRANSPORT_ENV] = transport
    configured_transport()  # a bad $SPECTRAX_MPMD_TRANSPORT fails here, before joining
    limit = configured_timeout()
    if world is not None and world < 1:
        raise DistributedError(f"initialize: num_processes must be at least 1, got {world}.")
    if pid is not None and world is not None and not 0 <= pid < world:
        raise DistributedError(
            f"initialize: process_id {pid} is not in [0, {world}) for a job of num_processes={world}; "
            "number the processes 0 … num_processes-1."
        )
    if address is None and world is None and pid is None and not _cluster_detected():
        return False
    if address is not None and pid is not None:
        host, port = _split_address(address)
        if pid == 0:
            _check_port_free(host, port)
        claim = _claim(host, port, pid)
        try:
            if pid != 0:
                _wait_reachable(host, port, limit)
            _join(address, world, pid, local_device_ids, limit)
        except BaseException:
            _release(claim)
            raise
        atexit.register(_release, claim)
    else:
        _join(address, world, pid, local_device_ids, limit)
    return True


def check_joined(where: str) -> None:
    """Refuse to go on in a process that its environment places in a job of several processes
    but that never joined it: it would run the whole job alone, next to its peers doing the same."""
    world = job_size_from_env()
    if world is not None and world > 1 and jax.process_count() == 1:
        raise DistributedError(
            f"{where}: ${WORLD_ENV}={world} and ${ID_ENV}={os.environ[ID_ENV]} make this process one "
            f"of a job of {world} processes, but it has not joined it (jax.process_count() is 1). Call "
            "spectrax_mpmd.initialize() at the start of the script, before anything touches a "
            "device (jax.devices(), create_mesh, creating arrays)."
        )


def _join(address, world, pid, local_device_ids, limit: float) -> None:
    """`jax.distributed.initialize`, which returns once every process has joined. Past the limit
    JAX ends a waiting process with an abort whose message blames a task that died; just before
    it, this process ends with an error that says what happened instead."""
    timeout = max(1, int(limit))
    watch = threading.Timer(max(0.5, timeout - min(1.0, 0.1 * timeout)), _not_joined, (world, pid, timeout))
    watch.daemon = True
    watch.start()
    try:
        jax.distributed.initialize(
            address,
            world,
            pid,
            local_device_ids=local_device_ids,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=max(2, int(2 * limit)),
            shutdown_timeout_seconds=timeout,
        )
    finally:
        watch.cancel()


def _not_joined(world, pid, timeout: int) -> None:
    size = f"all {world}" if world is not None else "all"
    sys.stderr.write(
        f"spectrax_mpmd.errors.DistributedError: process {'?' if pid is None else pid}: not {size} "
        f"processes of the job joined within {timeout} s: one started late, failed before "
        "spectrax_mpmd.initialize(), or was never started (JAX's coordinator would end this process "
        "with a message that a task died). Start every process within the timeout of the first, or "
        f"raise it (${TIMEOUT_ENV} or initialize(timeout=...)).\n"
    )
    leave(1)
