"""The environment settings of `spectrax_mpmd`: names, defaults and parsing, in one place.

`SPECTRAX_MPMD_*` are this package's own; `JAX_COORDINATOR_ADDRESS`,
`JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` describe the `jax.distributed` job (the
launcher sets them, `initialize` reads them). A leaf module: it imports nothing
of the package but its errors, so every layer can read its settings here.
"""

from __future__ import annotations

import os

from .errors import DistributedError, MpmdError

TIMEOUT_ENV = "SPECTRAX_MPMD_TIMEOUT"  # seconds a cross-process transfer may take
TRANSPORT_ENV = "SPECTRAX_MPMD_TRANSPORT"  # the cross-process transport, one of TRANSPORTS
HOST_ENV = "SPECTRAX_MPMD_TRANSFER_HOST"  # the address peers reach this process's transfer server at
CHECK_INPUTS_ENV = "SPECTRAX_MPMD_CHECK_INPUTS"  # when processes compare their arguments, one of INPUT_CHECKS
COMPILE_THREADS_ENV = "SPECTRAX_MPMD_COMPILE_THREADS"  # how many programs XLA compiles at once
RUN_AHEAD_ENV = "SPECTRAX_MPMD_RUN_AHEAD"  # cells a rank may issue ahead of its oldest unfinished one
FUSE_ENV = "SPECTRAX_MPMD_FUSE_CELLS"  # the most consecutive cells of a rank one program runs
WATCHDOG_ENV = "SPECTRAX_MPMD_WATCHDOG"  # whether a transfer waited for past the timeout ends the process
ADDRESS_ENV, WORLD_ENV, ID_ENV = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"

DEFAULT_TIMEOUT = 30.0
TRANSPORTS = ("transfer", "ppermute")
INPUT_CHECKS = ("host", "always", "first", "off")


def _positive(name: str, raw: str, parse: type, error: type[MpmdError], expected: str) -> int | float:
    """`raw`, the value of environment variable `name`, parsed by `parse` and checked positive;
    otherwise `error` saying what was expected."""
    try:
        value = parse(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise error(f"{name}={raw!r}: expected {expected}.")
    return value


def configured_timeout() -> float:
    """The transfer timeout in seconds: `$SPECTRAX_MPMD_TIMEOUT`, default 30."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    return _positive(TIMEOUT_ENV, raw, float, DistributedError, "a positive number of seconds, e.g. 30")


def configured_transport() -> str:
    """The cross-process transport: `$SPECTRAX_MPMD_TRANSPORT`, `"transfer"` (default) or `"ppermute"`."""
    name = os.environ.get(TRANSPORT_ENV, "transfer")
    if name not in TRANSPORTS:
        raise DistributedError(f"{TRANSPORT_ENV}={name!r}: expected one of {', '.join(TRANSPORTS)}.")
    return name


def configured_input_check() -> str:
    """When the processes of a job compare their arguments: `$SPECTRAX_MPMD_CHECK_INPUTS`,
    `"host"` (default: every call, values of host leaves; of device arrays at a signature's first
    call), `"always"` (every call, every readable leaf), `"first"` (each signature's first call)
    or `"off"`."""
    name = os.environ.get(CHECK_INPUTS_ENV, "host")
    if name not in INPUT_CHECKS:
        raise DistributedError(f"{CHECK_INPUTS_ENV}={name!r}: expected one of {', '.join(INPUT_CHECKS)}.")
    return name


def configured_compile_threads() -> int:
    """How many stage programs a first call compiles at once: `$SPECTRAX_MPMD_COMPILE_THREADS`,
    default the number of CPUs (1 compiles one program at a time: each program's compile time is
    then its own, and a large model's compiles do not hold their memory together)."""
    raw = os.environ.get(COMPILE_THREADS_ENV)
    if raw is None:
        return os.cpu_count() or 1
    return _positive(COMPILE_THREADS_ENV, raw, int, MpmdError, "a positive number of threads, e.g. 1 or 4")


DEFAULT_FUSE_CELLS = 256


def configured_fuse_cells() -> int:
    """The most consecutive cells of one rank a plan fuses into one program:
    `$SPECTRAX_MPMD_FUSE_CELLS`, default 256 (1: every cell its own call). Each fused
    program is compiled once per distinct run; longer runs mean fewer calls per step and
    larger programs to compile. 256 runs a 4-stage one-rank step of 32 microbatches as one
    program, which on CPU compiled and ran faster than its runs of 32
    (`benchmarks/fused_cells.py --limits 32`)."""
    raw = os.environ.get(FUSE_ENV)
    if raw is None:
        return DEFAULT_FUSE_CELLS
    return _positive(FUSE_ENV, raw, int, MpmdError, "a positive number of cells, e.g. 256 (1: no fusion)")


def configured_watchdog() -> bool:
    """Whether a call's wait for another process's transfer is bounded by the timeout (a hang
    becomes an error naming the transfer and what the peer waits for): `$SPECTRAX_MPMD_WATCHDOG`,
    `on` (default) or `off` (such a wait blocks until the transfer arrives)."""
    raw = os.environ.get(WATCHDOG_ENV, "on").strip().lower()
    if raw not in ("on", "off"):
        raise DistributedError(f"{WATCHDOG_ENV}={raw!r}: expected on or off.")
    return raw == "on"


DEFAULT_RUN_AHEAD = 4


def configured_run_ahead() -> int | None:
    """How many cells a rank may have issued ahead of its oldest unfinished one:
    `$SPECTRAX_MPMD_RUN_AHEAD`, a positive number or `none` (no bound); by default 4 on an
    accelerator (a cell's result is ready some time after its issue however small the cell,
    about three cells' issue on a TPU; a smaller bound makes the host wait on every cell), none
    on CPU devices (their buffers are the host's memory, and waiting there costs the host time
    it would spend issuing)."""
    raw = os.environ.get(RUN_AHEAD_ENV)
    if raw is None:
        import jax  # here: a leaf module, read before JAX picks its devices

        return None if jax.default_backend() == "cpu" else DEFAULT_RUN_AHEAD
    if raw.strip().lower() == "none":
        return None
    return _positive(RUN_AHEAD_ENV, raw, int, MpmdError, "a positive number of cells, e.g. 2, or none")


def transfer_host() -> str | None:
    """`$SPECTRAX_MPMD_TRANSFER_HOST`, or None when unset (the transport then picks the address)."""
    return os.environ.get(HOST_ENV) or None


def coordinator_from_env() -> str | None:
    """`$JAX_COORDINATOR_ADDRESS`, or None when unset."""
    return os.environ.get(ADDRESS_ENV) or None


def int_env(name: str) -> int | None:
    """The integer in environment variable `name`, None when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(f"${name}={raw!r}: expected an integer.") from None


def job_size_from_env() -> int | None:
    """The number of processes `$JAX_NUM_PROCESSES` gives this process's job when
    `$JAX_PROCESS_ID` is set too (as the launcher and the documented host commands set
    them); None otherwise, or when either is not an integer (`initialize` reports that)."""
    try:
        world, pid = int(os.environ.get(WORLD_ENV, "")), int(os.environ.get(ID_ENV, ""))
    except ValueError:
        return None
    return world if pid >= 0 else None
