"""Test setup: eight fake CPU devices, configured before JAX is imported."""

import contextlib
import fcntl
import os
import tempfile

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# LLVM codegen without optimization: compiles dominate the suite and take a third less time
# this way; every test compares programs built with the same flags (and subprocesses inherit them)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
# one worker per core (pyproject's `-n auto`): compiling a step's programs on more threads than that
# only contends, and one thread keeps the suite off concurrent XLA compiles in one process (a worker
# once died of a segfault inside XLA's CPU compiler there); tests of parallel compiles set their own
os.environ.setdefault("SPECTRAX_MPMD_COMPILE_THREADS", "1")
# the planner's profiles go to a folder of this run's, not the user's cache (~/.cache/spectrax_mpmd)
os.environ["SPECTRAX_MPMD_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="spectrax-profiles-")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)


# Tests marked `timing` compare a prediction with a measured run: the suite's other workers pause
# while one runs, so that it measures this process and not a neighbour's load. Every test holds a
# shared lock on `.run` while it runs (setup, call and teardown); a timing test holds it alone.
# `.gate` queues the waiters in order, so that a timing test is not starved by shared holders.
def _lock_paths() -> tuple[str, str] | None:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return None
    base = os.path.join(tempfile.gettempdir(), f"spectrax-tests-{run_id}")
    return base + ".gate", base + ".run"


@contextlib.contextmanager
def _machine_share(exclusive: bool):
    paths = _lock_paths()
    if paths is None:
        yield
        return
    with open(paths[0], "a") as gate, open(paths[1], "a") as run:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(run, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(run, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _machine_share(exclusive=item.get_closest_marker("timing") is not None):
        yield
