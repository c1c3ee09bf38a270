"""The benchmarks' timing helper (`benchmarks/_timing.py`): its figures on known numbers, that no
benchmark script reads a clock itself (each goes through the helper, one definition of spread), and
that none divides by a CPU-clock figure, which a coarse clock reads as 0, without `ratio`."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
CLOCKS = {"perf_counter", "perf_counter_ns", "thread_time", "thread_time_ns", "process_time",
          "process_time_ns", "monotonic", "monotonic_ns", "time_ns", "timeit"}  # fmt: skip


def _timing():
    spec = importlib.util.spec_from_file_location("_timing", BENCH / "_timing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_min_median_spread_on_known_numbers():
    t = _timing()
    wall = [0.004, 0.001, 0.003, 0.005, 0.002]  # seconds per round
    cpu = [0.0010, 0.0030, 0.0020, 0.0020, 0.0040]
    s = t.summary(wall, cpu)
    assert s["min_ms"] == pytest.approx(1.0) and s["median_ms"] == pytest.approx(3.0)
    assert s["spread"] == pytest.approx((5 - 1) / 3)  # (max - min) / median
    assert s["cpu_min_ms"] == pytest.approx(1.0) and s["cpu_median_ms"] == pytest.approx(2.0)
    assert set(s) == {"min_ms", "median_ms", "spread", "cpu_min_ms", "cpu_median_ms"}
    us = t.summary([2e-6, 4e-6], unit="us")  # an even count: the mean of the middle two
    assert us == pytest.approx({"min_us": 2.0, "median_us": 3.0, "spread": 2 / 3})
    assert t.summary([0.5, 0.5, 0.5], unit="s") == {"min_s": 0.5, "median_s": 0.5, "spread": 0.0}
    assert t.spread([1.0, 2.0, 4.0]) == pytest.approx(1.5)


def test_interleaved_rounds_calls_setup_and_after():
    """Contenders alternate within each round; setup and after run around each contender's calls;
    the CPU figure is per call (a fake clock that advances 1 s a read: 1 s over 4 calls)."""
    t = _timing()
    log = []
    contenders = {name: (lambda name=name: log.append(name) or name) for name in ("a", "b")}
    fake = itertools.count()
    wall, cpu = t.interleaved(
        contenders,
        rounds=3,
        calls=4,
        setup=lambda name: log.append(f"setup {name}"),
        after=lambda name, out: log.append(f"after {name} {out}"),
        wait=None,
        clock=lambda: next(fake),
    )
    one_round = ["setup a", *"aaaa", "after a a", "setup b", *"bbbb", "after b b"]
    assert log == one_round * 3
    assert {k: len(v) for k, v in wall.items()} == {"a": 3, "b": 3}
    assert cpu == {"a": [0.25] * 3, "b": [0.25] * 3}
    assert all(w >= 0 for v in wall.values() for w in v)
    # the clock read once around the 3 calls (1 tick: 1/3 a call) or around each call (1 tick each)
    for issue_cpu_only, per_call in ((False, 1 / 3), (True, 1.0)):
        _, cpu = t.interleaved({"a": lambda: None}, rounds=2, calls=3, wait=None,
                               issue_cpu_only=issue_cpu_only, clock=lambda: next(fake))  # fmt: skip
        assert cpu == {"a": [pytest.approx(per_call)] * 2}
    with pytest.raises(ValueError, match="wait="):
        t.interleaved(contenders, 1, wait="sometimes")


def test_a_ratio_to_a_figure_measured_as_zero_is_none_and_prints_as_such():
    t = _timing()
    assert t.ratio(3.0, 2.0) == 1.5 and t.times(t.ratio(3.0, 2.0)) == "1.50x"
    assert t.ratio(3.0, 0.0) is None and t.times(t.ratio(3.0, 0.0)) == "n/a"
    wall, cpu = t.interleaved({"a": lambda: sum(range(1000))}, rounds=2, calls=50, wait=None)
    assert t.issue_clock().name in ("thread CPU", "wall") and min(cpu["a"]) > 0  # the default clock


CPU_FIGURE = re.compile(r"cpu(?!_count)|issue_(s|us|ms)\b|per_cell_us")  # a figure, not a core count


def cpu_divisions(source: str) -> list[str]:
    """Divisions whose divisor is a CPU-clock figure (`cpu`, `issue_us`, `per_cell_us` in its
    code): on a machine whose thread clock ticks coarsely such a figure measures 0."""
    divisions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
    return [f"line {n.lineno}: {ast.unparse(n)}" for n in divisions if CPU_FIGURE.search(ast.unparse(n.right))]


def test_no_benchmark_divides_by_a_cpu_figure_without_ratio():
    planted = "r = cpu[w][n] / raw_cpu\nq = host.per_cell_us / host.calls_per_cell_us\nok = ms / cells\n"
    assert len(cpu_divisions(planted)) == 2
    scripts = sorted(BENCH.glob("*.py"))
    offenders = {p.name: hits for p in scripts if (hits := cpu_divisions(p.read_text()))}
    assert offenders == {}, offenders


def clock_reads(source: str) -> list[str]:
    """The clocks a script's code reads itself (names and attributes; prose is not code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in CLOCKS:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in CLOCKS:
            found.append(f"line {node.lineno}: {node.id}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = {a.name for a in node.names} | {getattr(node, "module", None)}
            if names & (CLOCKS | {"time"}):
                found.append(f"line {node.lineno}: import {sorted(n for n in names if n)}")
    return found


def test_the_clock_check_finds_a_planted_loop():
    planted = "import time\nt0 = time.perf_counter()\nfor _ in range(3):\n    f()\n"
    planted += "t = time.perf_counter() - t0\n"
    assert len(clock_reads(planted)) == 3
    assert clock_reads('"""Uses `time.thread_time` (prose)."""\nx = 1\n') == []


def test_no_benchmark_script_times_by_itself():
    """Every benchmark's timing loop and spread come from `_timing` (interleaved, once, summary)."""
    scripts = sorted(p for p in BENCH.glob("*.py") if p.name != "_timing.py")
    assert len(scripts) >= 15
    offenders = {p.name: hits for p in scripts if (hits := clock_reads(p.read_text()))}
    assert offenders == {}, offenders
    spread_without_helper = [
        p.name for p in scripts if "spread" in p.read_text() and "from _timing import" not in p.read_text()
    ]
    assert spread_without_helper == []
