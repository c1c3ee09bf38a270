"""One-rank pipelined steps against `lax.scan` of the same microbatches, with cells fused or each its
own call: the host's cost per schedule cell on one device.

One rank (JAX's default device: the accelerator where there is one) trains a 4-layer tanh MLP
(D x D) on `batch` rows: Std1F1B with one stage, or InterleavedH1 with the 4 layers as 4 virtual
stages; m microbatches. Per configuration, over `--rounds` interleaved rounds (each call waited
for):

  scan       one `jax.jit` of a `lax.scan` accumulating `value_and_grad` over the same microbatches
  fused      the pipelined step (`sxvalue_and_grad`) as built by default: consecutive cells of the
             rank run as one program (at most `$SPECTRAX_MPMD_FUSE_CELLS` cells each)
  unfused    the same step built with `SPECTRAX_MPMD_FUSE_CELLS=1`: one call per cell
  raw call   one `jax.jit(value_and_grad(loss))` call on one microbatch: a raw call's issue time

Reported: each step's wall time over the scan's, wall microseconds per schedule cell, the
compiled calls the step issues, the issuing thread's CPU time per issued call (the plan's issue
time, `step.profile`) against the raw call's, and each step's first call (trace and compile
included). On CPU a small program whose inputs are ready runs on the calling thread, so there a
fused call's issue time holds its arithmetic too. The results are checked against
`jax.value_and_grad` of the unsplit loss (rtol 1e-5) before timing.

    python benchmarks/fused_cells.py [--rounds 7] [--sizes 256/64,1024/256,4096/2048]
        [--json benchmarks/results/fused_cells.json]

On a machine where `SPECTRAX_MPMD_FUSE_CELLS` is not known (a build without fusion) both steps
are the same: run it from that tree to measure it.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
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


def scan_of(m: int):
    grad = jax.value_and_grad(loss)

    def scan(params, batch):
        xs, ys = (a.reshape(m, -1, a.shape[-1]) for a in batch)

        def body(carry, mb):
            value, g = carry
            v, gi = grad(params, mb)
            return (value + v / m, jax.tree.map(lambda a, b: a + b / m, g, gi)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, zero, (xs, ys))[0]

    return jax.jit(scan)


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
    steps = getattr(plan, "hot_steps", plan.steps)
    return sum(1 for st in steps if not hasattr(st.fn, "targets"))


def measure(d: int, batch: int, label: str, rounds: int) -> dict:
    v, m = CONFIGS[label]
    device = jax.devices()[0]
    keys = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.device_put(jax.random.normal(k, (d, d)) / d**0.5, device) for k in keys[:LAYERS]]
    data = tuple(jax.device_put(jax.random.normal(k, (batch, d)), device) for k in keys[LAYERS:])
    args = (params, data)
    schedule = S.InterleavedH1(microbatches=m, virtual_stages=v) if v > 1 else S.Std1F1B(microbatches=m)
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    made = {
        "fused": built(schedule, v > 1, mesh, None, args),
        "unfused": built(schedule, v > 1, mesh, "1", args),
    }
    steps = {name: step for name, (step, _) in made.items()}
    scan, raw = scan_of(m), jax.jit(jax.value_and_grad(loss))
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
    for name, step in steps.items():
        plan = step.plan_for(*args)
        host = step.profile(*args, rounds=rounds)
        calls = issued_calls(plan)
        row[f"{name}_first_s"] = made[name][1]
        row[f"{name}_cells"] = host.cells
        row[f"{name}_calls"] = calls
        row[f"{name}_vs_scan"] = t[name]["median_us"] / t["scan"]["median_us"]
        row[f"{name}_vs_scan_min"] = t[name]["min_us"] / t["scan"]["min_us"]
        row[f"{name}_us_per_cell"] = t[name]["median_us"] / host.cells
        row[f"{name}_issue_us_per_call"] = host.issue_s * 1e6 / calls
        row[f"{name}_issue_per_call_vs_raw"] = ratio(
            host.issue_s * 1e6 / calls, t["raw call"]["cpu_median_us"]
        )
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
    ("fused_issue_per_call_vs_raw", "call/raw", "8.2f"),
    ("unfused_median_us", "unfused", "9.0f"),
    ("unfused_vs_scan", "/scan", "6.2f"),
    ("unfused_us_per_cell", "us/cell", "8.1f"),
    ("unfused_calls", "calls", "5"),
    ("unfused_issue_per_call_vs_raw", "call/raw", "8.2f"),
    ("raw call_cpu_median_us", "raw us", "7.1f"),
    ("fused_first_s", "first s", "8.2f"),
    ("unfused_first_s", "unfused", "8.2f"),
]


def print_row(row: dict) -> None:
    cells = []
    for key, _, spec in COLUMNS:
        value = row.get(key)
        cells.append(format("n/a", ">" + spec.split(".")[0]) if value is None else format(value, ">" + spec))
    print(" ".join(cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="256/64,1024/256,4096/2048", help="D/batch pairs")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="of: " + ", ".join(CONFIGS))
    ap.add_argument("--json", default="benchmarks/results/fused_cells.json")
    args = ap.parse_args()
    device = jax.devices()[0]
    print(f"{device.device_kind}; issue times on the {issue_clock().name} clock")
    print(" ".join(format(title, ">" + spec.split(".")[0]) for _, title, spec in COLUMNS))
    rows = []
    for size in args.sizes.split(","):
        d, batch = (int(x) for x in size.split("/"))
        for label in args.configs.split(","):
            rows.append(measure(d, batch, label, args.rounds))
            print_row(rows[-1])
    result = {"device": device.device_kind, "clock": issue_clock().name, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
