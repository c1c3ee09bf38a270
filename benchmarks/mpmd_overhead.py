"""MPMD train-step overhead against single-device references, side by side in one run.

Model: a 4-layer tanh MLP (D -> D) with an MSE loss, m = 8 microbatches,
4 pipeline ranks on 4 fake CPU devices. Virtual-stage schedules (v = 2) cut
each layer in two stages (matmul | bias + tanh), so the arithmetic is the same.

Columns, per schedule and size:
  mpmd_ms       the pipelined train step (sxvalue_and_grad), median over rounds
  scan_ms       (a) one-device jax.jit of a lax.scan over the same m microbatches
  unsplit_ms    (b) one-device jax.jit(jax.value_and_grad) of the whole batch
  vs_scan / vs_unsplit   ratios (targets vs_scan <= 2.5 small, <= 1.15 large)
  issue_us/cell host time to issue one cell (with its transfer), and the floor
                measured in the same run: one bare compiled call + one device_put
  first_call_s  trace + split + compile + run, vs the unsplit step's first call
  peak          measured live activations per rank vs schedule.peak_activations
  sxlib_ms / sxlib_vs_scan   the same step through the optional AGPL `spectrax-lib`
                package (import spectrax; measured only, none of its code is used here):
                its sxjit + sxvalue_and_grad on its 4-rank mesh over the same devices, with
                params (and x / y) placed first on the devices of the stages that use
                them; its loss and grads are checked against jax.value_and_grad first.
                `n/a` when it is not installed or has no equivalent schedule.

Run: python benchmarks/mpmd_overhead.py [--rounds 7] [--sizes small,large]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("LOGGING_LEVEL_ED", "WARNING")  # spectrax-lib logs every stage compile at INFO

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402

SIZES = {"small": (256, 64), "large": (1024, 256)}
LAYERS, RANKS, MICRO = 4, 4, 8


def schedules():
    return {
        "GPipe": S.GPipe(microbatches=MICRO),
        "Std1F1B": S.Std1F1B(microbatches=MICRO),
        "ZeroBubbleH1": S.ZeroBubbleH1(microbatches=MICRO),
        "InterleavedH1(v=2)": S.InterleavedH1(microbatches=MICRO, virtual_stages=2),
        "DualPipeV": S.DualPipeV(microbatches=MICRO),
    }


def init(key, d):
    ks = jax.random.split(key, LAYERS)
    return [{"w": jax.random.normal(k, (d, d)) / np.sqrt(d), "b": jnp.zeros((d,))} for k in ks]


def loss_fn(params, batch, *, v=1, marker=mp.sxstage_iter):
    """MSE of the MLP; `marker` (None: unmarked) cuts a stage after each layer, and also
    after each matmul when v == 2."""
    x, y = batch
    h = x
    for k, layer in enumerate(params):
        z = h @ layer["w"]
        if v == 2 and marker is not None:
            z = marker(z)
        h = jnp.tanh(z + layer["b"])
        if marker is not None and k < len(params) - 1:
            h = marker(h)
    return jnp.mean((h - y) ** 2)


def scan_reference(params, batch):
    x, y = batch
    xs = x.reshape(MICRO, -1, x.shape[-1])
    ys = y.reshape(MICRO, -1, y.shape[-1])
    grad = jax.value_and_grad(lambda p, b: loss_fn(p, b, marker=None))

    def body(carry, mb):
        loss, g = carry
        l, gi = grad(params, mb)
        return (loss + l / MICRO, jax.tree.map(lambda a, b: a + b / MICRO, g, gi)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(body, zero, (xs, ys))[0]


def timed(fn, rounds, calls):
    """Median over rounds of the mean time per call (blocking on every result)."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
        out.append((time.perf_counter() - t) / calls)
    return statistics.median(out)


def issue_floor(mesh, d, b, rounds):
    """One bare compiled call plus one device_put of its input to the next rank: host time."""
    s0 = jax.sharding.NamedSharding(mesh.submesh(0), jax.sharding.PartitionSpec())
    s1 = jax.sharding.NamedSharding(mesh.submesh(1), jax.sharding.PartitionSpec())
    w = jax.device_put(jnp.ones((d, d)) / d, s0)
    x = jax.device_put(jnp.ones((b // MICRO, d)), s0)
    f = jax.jit(lambda w, x: jnp.tanh(x @ w)).lower(w, x).compile()
    # the cheapest device_put form: a one-device target is given as the device itself
    s1 = mesh.submesh(1).devices.flat[0] if mesh.submesh(1).size == 1 else s1
    jax.block_until_ready(jax.device_put(f(w, x), s1))
    best = []
    for _ in range(rounds):
        t = time.perf_counter()
        outs = [jax.device_put(f(w, x), s1) for _ in range(200)]
        best.append((time.perf_counter() - t) / 200)
        jax.block_until_ready(outs)
    return statistics.median(best)


def load_sxlib():
    """The optional spectrax-lib pieces this benchmark drives, or None (reason printed once)."""
    try:
        from spectrax.runtime import schedules
        from spectrax.runtime.mpmd import sxjit, sxstage_iter, sxvalue_and_grad
        from spectrax.runtime.types import MpMdMesh
    except Exception as e:  # ImportError when absent; anything else when installed but unusable
        print(f"spectrax-lib column skipped: import spectrax failed ({type(e).__name__}: {e}).")
        return None
    lib = SimpleNamespace(sxjit=sxjit, sxstage_iter=sxstage_iter, sxvalue_and_grad=sxvalue_and_grad)
    lib.MpMdMesh = MpMdMesh
    lib.schedules = {
        "GPipe": lambda: schedules.GPipe(microbatches=MICRO),
        "Std1F1B": lambda: schedules.Std1F1B(microbatches=MICRO),
        "ZeroBubbleH1": lambda: schedules.ZeroBubbleH1(microbatches=MICRO),
        "InterleavedH1(v=2)": lambda: schedules.InterleavedH1(microbatches=MICRO, virtual_stages=2),
        "DualPipeV": lambda: schedules.DualPipeV(microbatches=MICRO),
    }
    print("spectrax-lib found: its sxjit + sxvalue_and_grad is the sxlib column.")
    return lib


def sxlib_step(lib, mesh, name, params, batch):
    """spectrax-lib's train step for schedule `name`, and its arguments placed on their stages.

    Its runtime wants each leaf already on the rank of the one stage that uses it, so the
    params of logical stage s (and x on the first stage, y on the last) are placed on the
    rank its schedule maps s to (`logical_at`), before any timing.
    """
    sched = lib.schedules[name]()
    v = sched.virtual_stages_per_rank()
    owner = {sched.logical_at(r, j, RANKS): r for r in range(RANKS) for j in range(v)}
    lib_mesh = lib.MpMdMesh(mesh.jax_mesh, "pp")

    def put(a, logical):
        where = jax.sharding.NamedSharding(lib_mesh.submesh(owner[logical]), jax.sharding.PartitionSpec())
        return jax.device_put(a, where)

    placed = [{"w": put(p["w"], v * k), "b": put(p["b"], v * k + v - 1)} for k, p in enumerate(params)]
    x, y = batch
    args = (placed, (put(x, 0), put(y, RANKS * v - 1)))
    fn = lib.sxjit(
        lambda p, bt: loss_fn(p, bt, v=v, marker=lib.sxstage_iter), mesh=lib_mesh, schedule=sched, batch_argnums=(1,)
    )
    return lib.sxvalue_and_grad(fn), args


def max_abs_err(got, want):
    """Largest |got - want| over matching pytrees (loss, grads); inf when the structures differ."""
    if jax.tree.structure(got) != jax.tree.structure(want):
        return float("inf")
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in pairs)


def matches(got, want):
    """Allclose at fp32 rtol 1e-5 (atol 1e-7: microbatch means are summed in another order)."""
    if jax.tree.structure(got) != jax.tree.structure(want):
        return False
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7) for a, b in pairs)


def run(sizes, rounds, lib=None):
    mesh = mp.create_mesh((RANKS, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:RANKS])
    rows = []
    reported = set()
    for size in sizes:
        d, b = SIZES[size]
        key = jax.random.key(0)
        params = init(key, d)
        batch = (jax.random.normal(key, (b, d)), jax.random.normal(jax.random.key(1), (b, d)))
        one = jax.devices()[0]
        params1, batch1 = jax.device_put((params, batch), one)
        t = time.perf_counter()
        unsplit = jax.jit(jax.value_and_grad(lambda p, bt: loss_fn(p, bt, marker=None)))
        reference = jax.block_until_ready(unsplit(params1, batch1))
        unsplit_first = time.perf_counter() - t
        scan = jax.jit(scan_reference)
        jax.block_until_ready(scan(params1, batch1))
        floor = issue_floor(mesh, d, b, rounds)
        for name, sched in schedules().items():
            v = sched.virtual_stages
            fn = lambda p, bt, v=v: loss_fn(p, bt, v=v)  # noqa: E731
            step = mp.sxvalue_and_grad(fn, mesh=mesh, schedule=sched)
            t = time.perf_counter()
            jax.block_until_ready(step(params, batch))
            first = time.perf_counter() - t
            plan = step.plan_for(params, batch)
            # schedule cells actually run (a fused F&B counts as its two halves; the last
            # stage's scheduled backward is part of its fused loss cell and counts as none)
            n_cells = sum(len(cell.split("&")) for _, _, cell in plan.log if cell != "-")
            sx, sx_ok, sx_err = None, None, None
            if lib is not None and name not in lib.schedules and name not in reported:
                reported.add(name)
                print(f"spectrax-lib column n/a for {name}: it has no equivalent schedule.")
            elif lib is not None and name in lib.schedules:
                try:
                    sx_step, sx_args = sxlib_step(lib, mesh, name, params, batch)
                    loss, (grads,) = jax.block_until_ready(sx_step(*sx_args))
                    sx = lambda: sx_step(*sx_args)  # noqa: E731
                except Exception as e:
                    if name not in reported:
                        reported.add(name)
                        print(f"spectrax-lib column n/a for {name}: building its step failed ({type(e).__name__}: {e})")
                if sx is not None:
                    sx_ok, sx_err = matches((loss, grads), reference), max_abs_err((loss, grads), reference)
                    if not sx_ok:
                        print(
                            f"NOTE spectrax-lib {name} ({size}): loss/grads differ from jax.value_and_grad "
                            f"(max abs err {sx_err:.3g}); its timing is still shown."
                        )
            calls = 3 if size == "large" else 10
            times = {"mpmd": [], "scan": [], "unsplit": [], "sxlib": []}
            for _ in range(rounds):
                times["mpmd"].append(timed(lambda: step(params, batch), 1, calls))
                times["scan"].append(timed(lambda: scan(params1, batch1), 1, calls))
                times["unsplit"].append(timed(lambda: unsplit(params1, batch1), 1, calls))
                if sx is not None:
                    times["sxlib"].append(timed(sx, 1, calls))
            med = {k: statistics.median(v_) for k, v_ in times.items() if v_}
            issue = []
            for _ in range(rounds):
                jax.block_until_ready(step(params, batch))
                t = time.perf_counter()
                out = step(params, batch)
                issue.append(time.perf_counter() - t)
                jax.block_until_ready(out)
            issue_per_cell = statistics.median(issue) / n_cells
            peaks = step.measure_peak_activations(params, batch)
            rows.append(
                {
                    "size": size,
                    "D": d,
                    "B": b,
                    "schedule": name,
                    "mpmd_ms": med["mpmd"] * 1e3,
                    "scan_ms": med["scan"] * 1e3,
                    "unsplit_ms": med["unsplit"] * 1e3,
                    "vs_scan": med["mpmd"] / med["scan"],
                    "vs_unsplit": med["mpmd"] / med["unsplit"],
                    "cells": n_cells,
                    "issue_us_per_cell": issue_per_cell * 1e6,
                    "floor_us": floor * 1e6,
                    "issue_vs_floor": issue_per_cell / floor,
                    "first_call_s": first,
                    "unsplit_first_call_s": unsplit_first,
                    "first_vs_unsplit": first / unsplit_first,
                    "peak_measured": peaks,
                    "peak_schedule": sched.peak_activations(RANKS),
                    "sxlib_ms": med["sxlib"] * 1e3 if sx else None,
                    "sxlib_vs_scan": med["sxlib"] / med["scan"] if sx else None,
                    "sxlib_matches_ref": sx_ok,
                    "sxlib_max_abs_err": sx_err,
                }
            )
            print_row(rows[-1])
    return rows


HEADER = (
    f"{'size':6} {'schedule':20} {'mpmd ms':>9} {'scan ms':>9} {'unspl ms':>9} {'vs scan':>8} "
    f"{'vs unspl':>8} {'us/cell':>8} {'floor us':>8} {'x floor':>7} {'first s':>8} {'x unspl':>7} "
    f"{'peak meas/sched':>16} {'sxlib ms':>9} {'sx/scan':>8}"
)


def fmt(x, spec):
    """`x` formatted with `spec`, or right-aligned n/a when it is None."""
    if x is None:
        return format("n/a", ">" + spec.split(".")[0])
    return format(x, spec)


def print_row(r):
    if not getattr(print_row, "headed", False):
        print(HEADER)
        print_row.headed = True
    print(
        f"{r['size']:6} {r['schedule']:20} {r['mpmd_ms']:9.2f} {r['scan_ms']:9.2f} {r['unsplit_ms']:9.2f} "
        f"{r['vs_scan']:8.2f} {r['vs_unsplit']:8.2f} {r['issue_us_per_cell']:8.1f} {r['floor_us']:8.1f} "
        f"{r['issue_vs_floor']:7.2f} {r['first_call_s']:8.2f} {r['first_vs_unsplit']:7.2f} "
        f"{str(max(r['peak_measured'])) + '/' + str(r['peak_schedule']):>16} "
        f"{fmt(r['sxlib_ms'], '9.2f')} {fmt(r['sxlib_vs_scan'], '8.2f')}",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "mpmd_overhead.json"))
    args = ap.parse_args()
    rows = run(args.sizes.split(","), args.rounds, load_sxlib())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
