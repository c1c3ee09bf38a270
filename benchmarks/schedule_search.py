"""The searched schedule against every named schedule of the same cut, on two stage-cost cases.

Cases (per-stage costs, T_F of a block = 1; I = B/2 unless said):
  lm   — an LM cut: a light embedding stage (0.3), uniform blocks, a heavy head and
         loss (2.5, the vocabulary projection); W = I.
  skew — embedding and head heavier than the blocks (2 and 3); W = 0.8·I, comm = 0.25.
  measured — the main job's LM (examples/train_lm.py: byte vocabulary, d_model 64, 4 blocks,
         sequences of 32) cut into 4 stages: each stage's F, B, I and W cell times measured
         by `profile_stages` on 4 fake CPU devices (n = 4 only).
For n in {4, 8, 16} ranks and m = 4n microbatches, with a memory budget of n live
activations per rank (1F1B's) and without one, prints each named schedule's simulated
makespan and peak, the search's result, and the search time over rounds: wall min, median and
spread ((max - min) / median), the thread's CPU median (JSON `timing`: `min_s`, `median_s`,
`spread`, `cpu_min_s`, `cpu_median_s`). Writes benchmarks/results/schedule_search.json.

    python benchmarks/schedule_search.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

from _timing import interleaved, summary  # noqa: E402

from spectrax_core import schedules as S  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "schedule_search.json"
_MEASURED: dict = {}  # n -> the measured StageCost, profiled once
NAMED = (S.GPipe, S.Std1F1B, S.Eager1F1B, S.ZeroBubbleH1, S.ZeroBubbleH2)


def lm(n: int) -> S.StageCost:
    f = (0.3,) + (1.0,) * (n - 2) + (2.5,)
    return S.StageCost(f, tuple(2 * x for x in f), f, f)


def skew(n: int) -> S.StageCost:
    f = (2.0,) + (1.0,) * (n - 2) + (3.0,)
    return S.StageCost(f, tuple(2 * x for x in f), f, tuple(0.8 * x for x in f), comm=0.25)


def measured(n: int) -> S.StageCost:
    """The main job's LM cut into `n` = 4 stages, its cells' times measured (µs) by `profile_stages`."""
    import jax

    import spectrax_mpmd as mp
    from spectrax_core.losses import softmax_cross_entropy
    from spectrax_core.models import TransformerLM

    lm = TransformerLM.init(jax.random.key(0), vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=256)
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    schedule = S.ZeroBubbleH1(microbatches=8)  # split backwards: I and W measured apart
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule)
    seq = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)
    profile = step.runner.step.profile_stages(mp.stage_blocks(lm, n), None, seq[:, :-1], seq[:, 1:], rounds=3)
    return profile.stage_cost()


def timed(fn, rounds: int):
    """`fn`'s result and its wall and thread CPU seconds over `rounds` runs (host work: nothing to
    wait for), as `_timing.summary` gives them in seconds."""
    result = {}

    def run():
        result["out"] = fn()

    wall, cpu = interleaved({"search": run}, rounds, wait=None)
    return result["out"], summary(wall["search"], cpu["search"], unit="s")


def case(name: str, make, n: int, m: int, budget, rounds: int) -> dict:
    if name == "measured" and n not in _MEASURED:
        _MEASURED[n] = make(n)
    cost = _MEASURED[n] if name == "measured" else make(n)
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
          f"{'search':>18} {'makespan':>9} {'peak':>5} {'search s (min/med)':>19} "
          f"{'spread':>6} {'cpu med':>8}")  # fmt: skip
    for name, make in (("lm", lm), ("skew", skew), ("measured", measured)):
        for n in (4,) if name == "measured" else (4, 8, 16):
            for budget in (n, None):
                r = case(name, make, n, 4 * n, budget, args.rounds)
                rows.append(r)
                b, s, w = r["named"][r["best_named"]], r["search"], r["timing"]
                print(
                    f"{name:5} {n:>3} {4 * n:>3} {budget!s:>6} {r['best_named']:>14} "
                    f"{b['makespan']:>9.4g} "
                    f"{s['schedule']:>18} {s['makespan']:>9.4g} {s['peak']:>5} "
                    f"{w['min_s']:>9.2f}/{w['median_s']:<9.2f} {w['spread']:6.2f} {w['cpu_median_s']:8.2f}"
                )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    print(f"wrote {OUT}")
    return rows


if __name__ == "__main__":
    main()
