"""Test setup: eight fake CPU devices, configured before JAX is imported."""

import contextlib
import fcntl
import gc
import os
import tempfile

import pytest
from slow_tests import read_list

os.environ["JAX_PLATFORMS"] = "cpu"
# LLVM codegen without optimization: compiles dominate the suite and take a third less time
# this way; every test compares programs built with the same flags (and subprocesses inherit them)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
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


# Each compiled CPU program holds a few memory mappings of its own while it lives, and JAX's caches
# keep the programs of every jitted call alive. A worker runs many test files one after the other:
# past the kernel's limit on mappings (vm.max_map_count, 65530 by default) XLA's CPU compiler can
# no longer map new code and the worker dies of a segfault. So each file's programs leave JAX's
# caches when the file ends.
@pytest.fixture(scope="module", autouse=True)
def _programs_freed_per_file():
    yield
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _machine_share(exclusive=item.get_closest_marker("timing") is not None):
        yield


def pytest_addoption(parser):
    parser.addoption(
        "--declared-slow-only",
        action="store_true",
        help="mark slow only the tests marked so in their files, not those of the measured list "
        "(slow_tests.txt): for a hand-picked selection, as CI's oldest-versions step runs",
    )


def pytest_collection_modifyitems(config, items):
    """Mark `slow` the tests the suite's runs measured as slow (`slow_tests.py` keeps the list),
    besides those marked in their files (launched processes, and tests sharing a slow fixture)."""
    if config.getoption("--declared-slow-only"):
        return
    slow = read_list()
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
