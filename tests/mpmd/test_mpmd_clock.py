"""The clock issuing is timed on: the thread CPU clock where it times one call, else the wall clock,
said so. On a machine whose thread CPU clock moves in 10 ms steps (gVisor, as cloud TPU machines run)
every call reads 0: the host-cost table and the benchmarks must give real figures there too."""

import importlib
import math
import time

import jax
import jax.numpy as jnp
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._runtime import clock as clocks
from spectrax_mpmd._runtime import measure

HOST_PROFILE = importlib.import_module("spectrax_mpmd._runtime.host_profile")  # the module, not its function

TICK = 0.01  # seconds: gVisor's CPU clock step


def ticking(clock, tick=TICK):
    """`clock` read only in steps of `tick`, as a tick-accounting kernel keeps CPU time."""
    return lambda: math.floor(clock() / tick) * tick


def test_a_fine_clock_steps_finely_a_ticking_one_by_its_tick_a_stopped_one_never():
    assert clocks.clock_step(time.perf_counter) <= clocks.FINE_S
    assert clocks.clock_step(ticking(time.perf_counter), budget_s=0.1, changes=2) == pytest.approx(TICK)
    assert clocks.clock_step(lambda: 1.0, budget_s=0.01) == math.inf


def test_a_coarse_thread_clock_falls_back_to_the_wall_clock_and_says_why(monkeypatch):
    assert clocks.issue_clock().name == "thread CPU"  # this machine's clock times a call
    monkeypatch.setattr(clocks, "clock_step", lambda clock: TICK)
    coarse = clocks.issue_clock.__wrapped__()
    assert coarse.name == "wall" and coarse.now is time.perf_counter
    assert "steps of 10 ms" in coarse.note and "wall clock" in coarse.note
    monkeypatch.setattr(clocks, "clock_step", lambda clock: math.inf)
    assert "did not move" in clocks.issue_clock.__wrapped__().note


def two_rank_step():
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])

    def loss(params, x):
        h = jnp.tanh(x @ params[0])
        return jnp.mean(jnp.tanh(mp.sxstage_iter(h) @ params[1]) ** 2)

    params = [jnp.eye(8) * 0.5, jnp.eye(8) * 0.25]
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.Std1F1B(microbatches=2))
    return step, (params, jnp.ones((4, 8)))


def test_the_host_table_is_real_on_a_coarse_thread_clock(monkeypatch):
    """With the thread clock ticking in 10 ms steps every call would read 0; the profile then times
    issuing on the wall clock, and the table says so."""
    monkeypatch.setattr(clocks, "clock_step", lambda clock: TICK)
    monkeypatch.setattr(HOST_PROFILE, "issue_clock", clocks.issue_clock.__wrapped__)
    step, args = two_rank_step()
    jax.block_until_ready(step(*args))
    report = step.profile(*args, rounds=2)
    assert report.clock == "wall" and report.as_dict()["clock"] == "wall"
    assert report.per_cell_us > 0 and all(row.issue_us > 0 for row in report.rows)
    assert "us issue wall time per cell" in report.table() and "steps of 10 ms" in report.table()


def test_cells_are_not_timed_on_a_process_clock_too_coarse_for_them(monkeypatch):
    monkeypatch.setattr(measure, "process_clock_step", lambda: TICK)
    with pytest.raises(ValueError, match="steps of 10 ms: too coarse to time a cell. Pass clock='wall'"):
        measure.clock_named("cpu", "timeline")
    assert measure.clock_named("wall", "timeline") is time.perf_counter
