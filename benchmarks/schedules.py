"""Simulated makespan, bubble and peak activations of the nine schedules.

For n in {4, 8} ranks and m in {8, 16, 32} microbatches, under three cost
models, prints one table per cost model and marks the best schedule of each
(n, m) row with `*` (shortest makespan, then least activation memory). Writes
everything to benchmarks/results/schedules.json.

Costs are per whole rank's layers: a schedule with v stages per rank runs
chunks of 1/v of them, so its per-stage costs are divided by v (transfer
latency is not). Memory is reported the same way: `mem` = peak (stage,
microbatch) activations / v, in units of one rank's activations.

    python benchmarks/schedules.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from spectrax_core.schedules import ALL_SCHEDULES, Cost, ScheduleError, simulate

RANKS = (4, 8)
MICROBATCHES = (8, 16, 32)
COSTS = {
    "unit (F=B=1, I=W=0.5)": dict(F=1, B=1, I=0.5, W=0.5),
    "F:I:W=1:1:1 (B=2)": dict(F=1, B=2, I=1, W=1),
    "F:I:W=1:1:1, comm=0.25": dict(F=1, B=2, I=1, W=1, comm=0.25),
}
OUT = pathlib.Path(__file__).parent / "results" / "schedules.json"


def _scaled(cost: dict, v: int) -> Cost:
    """Per-logical-stage costs of a schedule with v stages per rank."""
    return Cost(**{k: (x if k == "comm" else x / v) for k, x in cost.items()})


def measure(cost: dict, n: int, m: int) -> list[dict]:
    """One record per schedule: its figures on n ranks with m microbatches, or why it is invalid."""
    rows = []
    for cls in ALL_SCHEDULES:
        s = cls(m)
        try:
            t = simulate(s, n, _scaled(cost, s.virtual_stages))
        except ScheduleError as e:
            smallest = re.search(r"smallest valid microbatches is (\d+)", str(e))
            rows.append(
                {
                    "schedule": cls.__name__,
                    "error": str(e),
                    "smallest_valid_m": int(smallest.group(1)) if smallest else None,
                }
            )
            continue
        peak = max(t.peak_activations)
        rows.append(
            {
                "schedule": cls.__name__,
                "virtual_stages": s.virtual_stages,
                "makespan": t.makespan,
                "bubble": t.bubble_fraction,
                "peak_activations": peak,
                "peak_memory": peak / s.virtual_stages,
            }
        )
    valid = [r for r in rows if "error" not in r]
    best = min(valid, key=lambda r: (round(r["makespan"], 9), r["peak_memory"]))
    for r in rows:
        r["best"] = r is best
    return rows


def _table(name: str, results: dict) -> str:
    lines = [f"\n## cost model: {name}", ""]
    lines.append(
        f"{'n':>2} {'m':>3}  {'schedule':<24} {'makespan':>9} {'bubble':>7} "
        f"{'peak act':>9} {'mem':>6}"
    )
    for (n, m), rows in results.items():
        for r in rows:
            label = ("*" if r["best"] else " ") + r["schedule"]
            if "error" in r:
                need = r["smallest_valid_m"]
                lines.append(f"{n:>2} {m:>3}  {label:<24} invalid: needs m >= {need}")
                continue
            lines.append(
                f"{n:>2} {m:>3}  {label:<24} {r['makespan']:>9.2f} {r['bubble']:>7.3f} "
                f"{r['peak_activations']:>9d} {r['peak_memory']:>6.1f}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(OUT), help="where to write the JSON report")
    out = pathlib.Path(parser.parse_args(argv).out)
    report = {}
    for name, cost in COSTS.items():
        results = {(n, m): measure(cost, n, m) for n in RANKS for m in MICROBATCHES}
        print(_table(name, results))
        rows = [{"n": n, "m": m, **r} for (n, m), rs in results.items() for r in rs]
        report[name] = {"cost": cost, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
