r"""One-rank pipelined steps against `lax.scan` of the same microbatches, with cells fused or each its
own call: the host's cost per schedule cell on one device.

One rank (JAX's default device: the accelerator where there is one) trains a 4-layer tanh MLP
(D x D) on `batch` rows: Std1F1B with one stage, or InterleavedH1 with the 4 layers as 4 virtual
stages; m microbatches. Per configuration, over `--rounds` interleaved rounds (each call waited
for):

  scan       one `jax.jit` of a `lax.scan` accumulating `value_and_grad` over the same microbatches
  fused      the pipelined step (`sxvalue_and_grad`) as built by default: consecutive cells of the
             rank run as one program (at most `$SPECTRAX_MPMD_FUSE_CELLS` cells each)
  unfused    the same step built with `SPECTRAX_MPMD_FUSE_CELLS=1`: one call per cell
  limitL     with `--limits L,...`: the step built with `SPECTRAX_MPMD_FUSE_CELLS=L`
  raw call   one `jax.jit(value_and_grad(loss))` call on one microbatch (for scale)

Reported per step: its wall time over the scan's, wall microseconds per schedule cell, the
compiled calls it issues, its first call (trace and compile included), and the issuing thread's
CPU time per issued call against `jax.jit`'s own dispatch of the same programs: each program
the plan issues (`plan.issued_specs`) wrapped in `jax.jit` with the same shardings and
donations and called in the plan's order on the same buffers (`jit us`). `issue/jit` is the
plan's issue (`Plan.run`) per call over that, `call/jit` the whole call's (arguments and
results included); these three are medians over 5 x `--rounds` interleaved rounds, the plan's
and the twins' clocks each started after the same untimed buffer setup. On CPU a
small program whose inputs are ready may run on the calling thread, so there a call's issue
time can hold its arithmetic, alike for both; and the Python work around the calls runs on
caches the program's arithmetic just used. The results are checked against
`jax.value_and_grad` of the unsplit loss (rtol 1e-5) before timing.

    python benchmarks/fused_cells.py [--rounds 7] [--sizes 256/64,1024/256,4096/2048]
        [--configs v1m8,v4m8,v4m32] [--limits 32,256] [--json benchmarks/results/fused_cells.json]

The one-chip table on a TPU (every size and configuration; the rows are written as they come,
so a run cut short keeps the finished ones): from the repository root on the device machine,
`.whl-tpu` carried, one command (its benchmark within 400 s) that records it there and
returns the record (and the benchmark's own JSON) under $OUT:

    PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl \
      && export PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD || exit; \
      PYTHONUNBUFFERED=1 timeout 400 python3 benchmarks/fused_cells.py --rounds 5 \
      --json benchmarks/results/tpu_fused_cells.json; \
      python3 benchmarks/figures.py record tpu_fused_cells --no-run; \
      cp docs/measurements/tpu_fused_cells.json $OUT/; \
      cp benchmarks/results/tpu_fused_cells.json $OUT/tpu_fused_cells_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _scan import scan_step
from _timing import interleaved, issue_clock, once, ratio, summary

import spectrax_mpmd as mp
from spectrax_core import schedules as S

LAYERS = 4
CONFIGS = {  # label -> (virtual stages, microbatches): 1 stage m=8, 4 virtual stages m=8 and m=32
    "v1m8": (1, 8),
    "v4m8": (4, 8),
    "v4m32": (4, 32),
}
FUSE_ENV = "SPECTRAX_MPMD_FUSE_CELLS"


def loss(params, batch, cut: bool = False):
    x, y = batch
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if cut and k < LAYERS - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


def built(schedule, cut: bool, mesh, fuse: str | None, args) -> tuple:
    """A pipelined step built with `$SPECTRAX_MPMD_FUSE_CELLS` = `fuse`, and its first call's
    wall seconds (tracing and compiling included)."""
    saved = os.environ.get(FUSE_ENV)
    if fuse is not None:
        os.environ[FUSE_ENV] = fuse
    try:
        step = mp.sxvalue_and_grad(lambda p, b: loss(p, b, cut), mesh=mesh, schedule=schedule)
        first_s, _ = once(lambda: step(*args))
    finally:
        os.environ.pop(FUSE_ENV, None)
        if saved is not None:
            os.environ[FUSE_ENV] = saved
    return step, first_s


def close(got, want) -> bool:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6) for a, b in pairs)


def issued_calls(plan) -> int:
    return sum(1 for spec in plan.issued_specs if spec is not None)


def placed_copies(plan, args) -> list:
    """Fresh copies of the plan's inputs on their shardings (a donated input is consumed)."""
    leaves = jax.tree.leaves(args)
    copies = [jnp.copy(leaves[key.leaf]) for _, key in plan.input_keys]
    return jax.block_until_ready(jax.device_put(copies, plan.input_shardings))


def jit_twins(plan) -> list:
    """Per step the plan issues, `jax.jit` of the same program with the same shardings and
    donations (one per distinct program; None for a copy)."""
    twins: dict = {}
    for spec in plan.issued_specs:
        if spec is not None and spec not in twins:
            twins[spec] = jax.jit(
                spec.fn,
                in_shardings=tuple(s.sharding for s in spec.in_specs),
                out_shardings=spec.out_shardings,
                donate_argnums=spec.donate,
                keep_unused=True,
            )
    return [twins.get(spec) for spec in plan.issued_specs]


def twins_issue_s(plan, twins: list, placed: list, clock) -> float:
    """The issuing thread's seconds in `jax.jit` calls of the plan's programs, called in the
    plan's order on its buffers (gathering arguments and storing results untimed)."""
    buf, spent = plan.buffers(placed), 0.0
    for (fn, ins, outs, frees), twin in zip(plan.hot_steps, twins):
        arguments = [buf[i] for i in ins]
        start = clock()
        results = (twin or fn)(*arguments)
        spent += clock() - start if twin is not None else 0.0
        for o, r in zip(outs, results):
            buf[o] = r
        for f in frees:
            buf[f] = None
    jax.block_until_ready(buf)
    return spent


def issue_per_call(steps: dict, args, rounds: int) -> dict:
    """Per step: the issuing thread's microseconds per issued call in the whole call, in
    `Plan.run` alone and in `jax.jit` calls of the same programs, each as (median, min) over
    interleaved rounds (fresh inputs for each run).

    The first work a thread does after a wait runs on cold caches (about 6 us of this machine's
    thread clock for two clock reads), so both sides start their clocks after the same untimed
    work: the twins after their buffer list is built and the first arguments gathered, `Plan.run`
    after one untimed build of the same list (touching the inputs and constants it starts from)."""
    clock = issue_clock().now
    plans = {name: step.plan_for(*args) for name, step in steps.items()}
    twins = {name: jit_twins(plan) for name, plan in plans.items()}
    spent: dict = {name: ([], [], []) for name in steps}
    for k in range(rounds + 1):  # the first round compiles the twins
        for name, plan in plans.items():
            start = clock()
            out = steps[name](*args)
            called = clock() - start
            jax.block_until_ready(out)
            placed = placed_copies(plan, args)
            plan.buffers(placed)  # as the twins' buffers are built before their clock starts
            start = clock()
            out = plan.run(placed)
            ran = clock() - start
            jax.block_until_ready(out)
            del out
            twin = twins_issue_s(plan, twins[name], placed_copies(plan, args), clock)
            if k:
                for samples, value in zip(spent[name], (called, ran, twin)):
                    samples.append(value)
    return {
        name: [
            (
                np.median(samples) * 1e6 / issued_calls(plans[name]),
                min(samples) * 1e6 / issued_calls(plans[name]),
            )
            for samples in spent[name]
        ]
        for name in steps
    }


def measure(d: int, batch: int, label: str, rounds: int, limits: list) -> dict:
    v, m = CONFIGS[label]
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.device_put(jax.random.normal(k, (d, d)) / d**0.5, device) for k in keys[:LAYERS]]
    data = tuple(jax.device_put(jax.random.normal(k, (batch, d)), device) for k in keys[LAYERS:])
    args = (params, data)
    schedule = S.InterleavedH1(microbatches=m, virtual_stages=v) if v > 1 else S.Std1F1B(microbatches=m)
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    variants = {"fused": None, "unfused": "1", **{f"limit{n}": str(n) for n in limits}}
    made = {name: built(schedule, v > 1, mesh, fuse, args) for name, fuse in variants.items()}
    steps = {name: step for name, (step, _) in made.items()}
    scan, raw = scan_step(jax.value_and_grad(loss), m), jax.jit(jax.value_and_grad(loss))
    micro = tuple(x[: batch // m] for x in data)
    reference = jax.value_and_grad(loss)(*args)
    for name, step in steps.items():
        if not close(step(*args), reference):
            raise SystemExit(
                f"{label} D={d}: the {name} step differs from value_and_grad of the unsplit loss"
            )
    contenders = {
        "scan": lambda: scan(*args),
        **{name: (lambda s=step: s(*args)) for name, step in steps.items()},
        "raw call": lambda: raw(params, micro),
    }
    for call in contenders.values():
        jax.block_until_ready(call())
    wall, cpu = interleaved(contenders, rounds, 5, issue_cpu_only=True)
    t = {name: summary(wall[name], cpu[name], unit="us") for name in contenders}
    row = {
        "size": f"D{d}B{batch}",
        "D": d,
        "batch": batch,
        "config": label,
        "microbatches": m,
        "virtual_stages": v,
    }
    row.update({f"{name}_{k}": value for name, s in t.items() for k, value in s.items()})
    per_call = issue_per_call(steps, args, 5 * rounds)  # cheap rounds: more of them
    for name, step in steps.items():
        plan = step.plan_for(*args)
        calls, cells = issued_calls(plan), sum(len(c.split("&")) for *_, c in plan.log if c != "-")
        (call_us, call_min), (run_us, run_min), (jit_us, jit_min) = per_call[name]
        row[f"{name}_first_s"] = made[name][1]
        row[f"{name}_cells"] = cells
        row[f"{name}_calls"] = calls
        row[f"{name}_vs_scan"] = t[name]["median_us"] / t["scan"]["median_us"]
        row[f"{name}_vs_scan_min"] = t[name]["min_us"] / t["scan"]["min_us"]
        row[f"{name}_us_per_cell"] = t[name]["median_us"] / cells
        row[f"{name}_issue_us_per_call"] = run_us
        row[f"{name}_jit_us_per_call"] = jit_us
        row[f"{name}_issue_per_call_vs_jit"] = ratio(run_us, jit_us)
        row[f"{name}_issue_per_call_vs_jit_min"] = ratio(run_min, jit_min)
        row[f"{name}_call_us_per_call"] = call_us
        row[f"{name}_call_per_call_vs_jit"] = ratio(call_us, jit_us)
        row[f"{name}_call_per_call_vs_jit_min"] = ratio(call_min, jit_min)
    return row


COLUMNS = [
    ("D", "D", "5"),
    ("batch", "batch", "5"),
    ("config", "config", "6"),
    ("scan_median_us", "scan us", "9.0f"),
    ("fused_median_us", "fused us", "9.0f"),
    ("fused_spread", "spread", "6.2f"),
    ("fused_vs_scan", "/scan", "6.2f"),
    ("fused_us_per_cell", "us/cell", "8.1f"),
    ("fused_calls", "calls", "5"),
    ("fused_jit_us_per_call", "jit us", "7.1f"),
    ("fused_issue_per_call_vs_jit", "issue/jit", "9.2f"),
    ("fused_call_per_call_vs_jit", "call/jit", "8.2f"),
    ("unfused_median_us", "unfused", "9.0f"),
    ("unfused_vs_scan", "/scan", "6.2f"),
    ("unfused_us_per_cell", "us/cell", "8.1f"),
    ("unfused_calls", "calls", "5"),
    ("unfused_issue_per_call_vs_jit", "issue/jit", "9.2f"),
    ("raw call_cpu_median_us", "raw us", "7.1f"),
    ("fused_first_s", "first s", "8.2f"),
    ("unfused_first_s", "unfused", "8.2f"),
]


def print_row(row: dict, limits: list) -> None:
    cells = []
    for key, _, spec in COLUMNS:
        value = row.get(key)
        cells.append(format("n/a", ">" + spec.split(".")[0]) if value is None else format(value, ">" + spec))
    print(" ".join(cells), flush=True)
    for n in limits:
        name = f"limit{n}"
        print(
            f"      at most {n} cells a program: {row[name + '_calls']} calls, "
            f"{row[name + '_vs_scan']:.2f}x the scan, first call {row[name + '_first_s']:.2f} s",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="256/64,1024/256,4096/2048", help="D/batch pairs")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    ap.add_argument("--limits", default="", help="cells per program of extra fused steps, e.g. 32,256")
    ap.add_argument("--json", default="benchmarks/results/fused_cells.json")
    args = ap.parse_args()
    limits = [int(n) for n in args.limits.split(",") if n]
    device = jax.devices()[0]
    print(f"{device.device_kind}; issue times on the {issue_clock().name} clock")
    print(" ".join(format(title, ">" + spec.split(".")[0]) for _, title, spec in COLUMNS))
    rows: list = []
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    for size in args.sizes.split(","):
        d, batch = (int(x) for x in size.split("/"))
        for label in args.configs.split(","):
            rows.append(measure(d, batch, label, args.rounds, limits))
            print_row(rows[-1], limits)
            result = {"device": device.device_kind, "clock": issue_clock().name, "rows": rows}
            Path(args.json).write_text(json.dumps(result, indent=1))  # each row kept as it comes
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
