"""The searched schedule against every named schedule of the same cut, on two stage-cost cases.

Cases (per-stage costs, T_F of a block = 1; I = B/2 unless said):
  lm   — an LM cut: a light embedding stage (0.3), uniform blocks, a heavy head and
         loss (2.5, the vocabulary projection); W = I.
  skew — embedding and head heavier than the blocks (2 and 3); W = 0.8·I, comm = 0.25.
For n in {4, 8, 16} ranks and m = 4n microbatches, with a memory budget of n live
activations per rank (1F1B's) and without one, prints each named schedule's simulated
makespan and peak, the search's result, and the search time (min / median / spread of
wall and thread CPU seconds over rounds). Writes benchmarks/results/schedule_search.json.

    python benchmarks/schedule_search.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from spectrax_core import schedules as S

OUT = pathlib.Path(__file__).parent / "results" / "schedule_search.json"
NAMED = (S.GPipe, S.Std1F1B, S.Eager1F1B, S.ZeroBubbleH1, S.ZeroBubbleH2)


def lm(n: int) -> S.StageCost:
    f = (0.3,) + (1.0,) * (n - 2) + (2.5,)
    return S.StageCost(f, tuple(2 * x for x in f), f, f)


def skew(n: int) -> S.StageCost:
    f = (2.0,) + (1.0,) * (n - 2) + (3.0,)
    return S.StageCost(f, tuple(2 * x for x in f), f, tuple(0.8 * x for x in f), comm=0.25)


def timed(fn, rounds: int):
    wall, cpu, out = [], [], None
    for _ in range(rounds):
        w, c = time.perf_counter(), time.thread_time()
        out = fn()
        wall.append(time.perf_counter() - w)
        cpu.append(time.thread_time() - c)
    stats = lambda xs: {"min": min(xs), "median": sorted(xs)[len(xs) // 2], "spread": max(xs) - min(xs)}  # noqa: E731
    return out, {"wall_s": stats(wall), "thread_cpu_s": stats(cpu)}


def case(name: str, make, n: int, m: int, budget, rounds: int) -> dict:
    cost = make(n)
    named = {}
    for cls in NAMED:
        t = S.simulate(cls(microbatches=m), n, cost)
        named[cls.__name__] = {"makespan": t.makespan, "peak": max(t.peak_activations)}
    fitting = {k: v for k, v in named.items() if budget is None or v["peak"] <= budget}
    best = min(fitting, key=lambda k: fitting[k]["makespan"])
    found, timing = timed(lambda: S.search(n, m, cost, memory_budget=budget), rounds)
    t = S.simulate(found, n, cost)
    return {
        "case": name, "n": n, "m": m, "budget": budget, "named": named, "best_named": best,
        "search": {"schedule": type(found).__name__, "makespan": t.makespan, "peak": max(t.peak_activations)},
        "timing": timing,
    }  # fmt: skip


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    rows = []
    print(f"{'case':5} {'n':>3} {'m':>3} {'budget':>6} {'best named':>14} {'makespan':>9} "
          f"{'search':>18} {'makespan':>9} {'peak':>5} {'search s (min/med)':>19}")  # fmt: skip
    for name, make in (("lm", lm), ("skew", skew)):
        for n in (4, 8, 16):
            for budget in (n, None):
                r = case(name, make, n, 4 * n, budget, args.rounds)
                rows.append(r)
                b, s, w = r["named"][r["best_named"]], r["search"], r["timing"]["wall_s"]
                print(
                    f"{name:5} {n:>3} {4 * n:>3} {str(budget):>6} {r['best_named']:>14} {b['makespan']:>9.2f} "
                    f"{s['schedule']:>18} {s['makespan']:>9.2f} {s['peak']:>5} "
                    f"{w['min']:>9.2f}/{w['median']:<9.2f}"
                )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    print(f"wrote {OUT}")
    return rows


if __name__ == "__main__":
    main()
