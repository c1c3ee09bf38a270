"""Overhead and host cost of MPMD train steps against one-device references, in one process.

Model: an L-layer tanh MLP (D -> D) with an MSE loss on fake CPU devices, one
pipeline rank per device. Sections (`--sections`, all by default):

  schedules  4 ranks, m = 8 microbatches, small (D=256, B=64) and large (D=1024,
             B=256): the pipelined step (`sxvalue_and_grad`) against (a) one-device
             `jax.jit` of a `lax.scan` over the same microbatches and (b) the unsplit
             step; issue CPU per schedule cell; live activations. Virtual-stage
             schedules (v=2) cut each layer into two stages (matmul | bias + tanh).
  scaling    8-layer D=256 MLP, microbatches of 8 rows, n in {2, 4, 8} ranks,
             m in {8, 16}, Std1F1B: step / scan as the number of ranks grows.
  first      first call (trace, split, lower, compile, relocate, plan, first run:
             `step.timings()`) against the unsplit step's first call.
  host       `step.profile()` of the small model, n=4, Std1F1B: issue CPU per rank
             and cell kind.
  lm         the main job's model (`examples/train_lm.py`: byte-level TransformerLM,
             d_model 128, 4 blocks, batch 32 x 64, 4 ranks x 1 device, Std1F1B, m=8,
             the optax update inside the plan) and a larger one (8 blocks, d_model
             512, 4 ranks x 2 devices, batch 8 x 64): the pipelined update step against the same
             model as one SPMD program on one rank's devices (the same microbatches
             accumulated by `lax.scan`), first calls with their phases, and the
             issue CPU per schedule cell by cause: the whole call (`call/cell`), its
             argument handling around the plan (`args/cell`), the plan's issue
             (`us/cell`) with what releasing buffers after their last use costs
             in it (`free/cell`) and what its calls and copies cost timed one by
             one (`calls/cell`), next to one cell's compiled call by itself (`cell
             call`, F / B / FB). `--lm-configs` picks the configurations.

Every timed figure comes from `--rounds` interleaved rounds (each round runs every
contender in turn, each call waited for): wall time min, median and spread
((max - min) / median), and the issuing thread's CPU time (`_timing.issue_clock`),
which other load on a shared machine barely moves. Writes every row as JSON.

    python benchmarks/mpmd_overhead.py [--rounds 7] [--sections schedules,scaling,first,host,lm]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("LOGGING_LEVEL_ED", "WARNING")  # spectrax-lib logs every stage compile at INFO

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _scan import scan_step  # noqa: E402
from _timing import interleaved, once, ratio, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

SIZES = {"small": (256, 64), "large": (1024, 256)}


def schedules(m: int) -> dict:
    return {
        "GPipe": S.GPipe(microbatches=m),
        "Std1F1B": S.Std1F1B(microbatches=m),
        "ZeroBubbleH1": S.ZeroBubbleH1(microbatches=m),
        "InterleavedH1(v=2)": S.InterleavedH1(microbatches=m, virtual_stages=2),
        "DualPipeV": S.DualPipeV(microbatches=m),
    }


# --- the model --------------------------------------------------------------------------------


def init(key, d: int, layers: int) -> list:
    ks = jax.random.split(key, layers)
    return [{"w": jax.random.normal(k, (d, d)) / np.sqrt(d), "b": jnp.zeros((d,))} for k in ks]


def batch_of(d: int, b: int) -> tuple:
    return jax.random.normal(jax.random.key(0), (b, d)), jax.random.normal(jax.random.key(1), (b, d))


def mlp_loss(params, batch, *, per_stage=1, v=1, marker=mp.sxstage_iter):
    """MSE of the MLP; `marker` (None: unmarked) cuts a stage after every `per_stage` layers,
    and with v == 2 also after each matmul (then per_stage must be 1)."""
    x, y = batch
    h = x
    for k, layer in enumerate(params):
        z = h @ layer["w"]
        if v == 2 and marker is not None:
            z = marker(z)
        h = jnp.tanh(z + layer["b"])
        if marker is not None and (k + 1) % per_stage == 0 and k < len(params) - 1:
            h = marker(h)
    return jnp.mean((h - y) ** 2)


def references(layers: int, m: int) -> tuple:
    """Fresh one-device references: (a) a lax.scan over m microbatches, (b) the unsplit step."""
    grad = jax.value_and_grad(functools.partial(mlp_loss, marker=None))
    return scan_step(grad, m), jax.jit(grad)


def pipeline(n: int, schedule, layers: int, d: int, b: int):
    """A fresh pipelined step over n ranks, its arguments, and one-device copies of them."""
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    v = schedule.virtual_stages
    loss = functools.partial(mlp_loss, per_stage=layers // (n * v) if v == 1 else 1, v=v)
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule)
    args = (init(jax.random.key(0), d, layers), batch_of(d, b))
    return step, args, jax.device_put(args, jax.devices()[0])


# --- measurement -------------------------------------------------------------------------------


def timed(contenders: dict, rounds: int, calls: int) -> dict:
    """Per contender: the summary of its wall and issuing-thread CPU seconds per call over
    interleaved rounds."""
    wall, cpu = interleaved(contenders, rounds, calls)
    return {k: summary(wall[k], cpu[k]) for k in contenders}


def first_call(fn) -> float:
    return once(fn)[0]


def first_call_cpu(fn) -> tuple[float, float]:
    """Wall seconds and the process's CPU seconds (every thread: tracing, lowering, the compiler's
    threads, the first run) of a first call; CPU time barely moves with other load on the machine."""
    return once(fn)


def allclose(got, want) -> bool:
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    return all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7) for a, b in pairs)


def checked_first_call(step, args, reference) -> float:
    seconds = first_call(lambda: step(*args))
    if not allclose(step(*args), reference):
        raise SystemExit(f"{step.schedule!r}: the pipelined step differs from the unsplit step")
    return seconds


# --- sections ----------------------------------------------------------------------------------


def section_schedules(rounds: int, sizes: list, lib) -> list:
    rows = []
    for size in sizes:
        d, b = SIZES[size]
        for name, schedule in schedules(8).items():
            step, args, local = pipeline(4, schedule, 4, d, b)
            scan, unsplit = references(4, 8)
            reference = jax.block_until_ready(unsplit(*local))
            jax.block_until_ready(scan(*local))
            checked_first_call(step, args, reference)
            contenders = {
                "mpmd": lambda: step(*args),
                "scan": lambda: scan(*local),
                "unsplit": lambda: unsplit(*local),
            }
            sx = lib.step(name, step.mesh, args, mlp_loss) if lib is not None else None
            if sx is not None:
                contenders["sxlib"] = sx
            t = timed(contenders, rounds, 3 if size == "large" else 10)
            host = step.profile(*args, rounds=rounds)
            row = {
                "section": "schedules",
                "size": size,
                "D": d,
                "B": b,
                "schedule": name,
                **{f"{k}_{stat}": v for k, s in t.items() for stat, v in s.items()},
                "vs_scan_median": t["mpmd"]["median_ms"] / t["scan"]["median_ms"],
                "vs_scan_min": t["mpmd"]["min_ms"] / t["scan"]["min_ms"],
                "vs_unsplit_median": t["mpmd"]["median_ms"] / t["unsplit"]["median_ms"],
                "issue_us_per_cell": host.per_cell_us,
                "issue_share": host.issue_share,
                "calls": host.calls,
                "transfers": sum(r.transfers for r in host.rows),
                "copy_calls": host.copies,
                "peak_measured": step.measure_peak_activations(*args),
                "peak_schedule": schedule.peak_activations(4),
                "sxlib_vs_scan_median": t["sxlib"]["median_ms"] / t["scan"]["median_ms"] if sx else None,
            }
            rows.append(row)
            print_row(SCHEDULE_COLUMNS, row)
    return rows


def section_scaling(rounds: int) -> list:
    rows = []
    for m in (8, 16):
        for n in (2, 4, 8):
            step, args, local = pipeline(n, S.Std1F1B(microbatches=m), 8, 256, 8 * m)
            scan, unsplit = references(8, m)
            reference = jax.block_until_ready(unsplit(*local))
            jax.block_until_ready(scan(*local))
            checked_first_call(step, args, reference)
            t = timed({"mpmd": lambda: step(*args), "scan": lambda: scan(*local)}, rounds, 5)
            host = step.profile(*args, rounds=rounds)
            row = {
                "section": "scaling",
                "n": n,
                "m": m,
                **{f"{k}_{stat}": v for k, s in t.items() for stat, v in s.items()},
                "vs_scan_median": t["mpmd"]["median_ms"] / t["scan"]["median_ms"],
                "vs_scan_min": t["mpmd"]["min_ms"] / t["scan"]["min_ms"],
                "issue_us_per_cell": host.per_cell_us,
                "issue_share": host.issue_share,
            }
            rows.append(row)
            print_row(SCALING_COLUMNS, row)
    return rows


FIRST_CONFIGS = {
    "n=4 Std1F1B": (4, lambda: S.Std1F1B(microbatches=8)),
    "n=4 ZeroBubbleH1": (4, lambda: S.ZeroBubbleH1(microbatches=8)),
    "n=4 DualPipeV": (4, lambda: S.DualPipeV(microbatches=8)),
    "n=8 Std1F1B": (8, lambda: S.Std1F1B(microbatches=16)),
    "n=8 ZeroBubbleH1": (8, lambda: S.ZeroBubbleH1(microbatches=16)),
}


def section_first(repeats: int) -> list:
    """First calls of fresh functions (nothing cached), small model (D=256, B=64 x m/8);
    the n=8 configurations have 8 layers (one per rank). Min over `repeats` fresh builds."""
    rows = []
    for label, (n, make) in FIRST_CONFIGS.items():
        schedule = make()
        layers, m = n, schedule.microbatches
        best = None
        for _ in range(repeats):
            step, args, local = pipeline(n, schedule, layers, 256, 8 * m)
            _, unsplit = references(layers, m)
            unsplit_s = first_call(lambda: unsplit(*local))
            mpmd_s = checked_first_call(step, args, unsplit(*local))
            report = step.timings()
            if best is None or mpmd_s / unsplit_s < best["vs_unsplit"]:
                best = {
                    "section": "first",
                    "config": label,
                    "first_s": mpmd_s,
                    "unsplit_first_s": unsplit_s,
                    "vs_unsplit": mpmd_s / unsplit_s,
                    "compiled": report["compiled"],
                    "relocated": report["relocated"],
                    **{f"{k}_s": v for k, v in report["seconds"].items()},
                }
        rows.append(best)
        print_row(FIRST_COLUMNS, best)
    return rows


def section_host(rounds: int) -> list:
    step, args, _ = pipeline(4, S.Std1F1B(microbatches=8), 4, *SIZES["small"])
    jax.block_until_ready(step(*args))
    report = step.profile(*args, rounds=rounds)
    print(report.table())
    return [{"section": "host", **report.as_dict()}]


# the main job's LM (examples/train_lm.py defaults) and a larger one: d_model, blocks, devices per
# rank, sequences per step (the larger model's step takes seconds on CPU: one sequence per microbatch)
LM_CONFIGS = {"lm": (128, 4, 1, 32), "lm-large": (512, 8, 2, 8)}


def lm_steps(d_model: int, blocks: int, per_rank: int, sequences: int, n: int = 4, m: int = 8) -> tuple:
    """Fresh update steps of the LM: pipelined over n ranks of `per_rank` devices, and unsplit (one
    SPMD program over one rank's devices, the same microbatches accumulated by `lax.scan`: the
    same arithmetic); with the model, its optimizer and a batch of `sequences` x 64 bytes."""
    devices = jax.devices()[: n * per_rank]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=256, d_model=d_model, n_layers=blocks, n_heads=4, d_ff=4 * d_model
    )
    pipe = mp.create_mesh((n, 1, per_rank, 1, 1, 1), mpmd_axis="pp", devices=devices)
    spmd = mp.create_mesh((1, 1, per_rank, 1, 1, 1), devices=devices[:per_rank])
    mpmd_step = mp.runner(mesh=pipe, loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(microbatches=m), tx=tx)
    spmd_step = mp.runner(mesh=spmd, loss_fn=softmax_cross_entropy, microbatches=m, tx=tx)
    window = np.random.default_rng(0).integers(0, 256, (sequences, 65)).astype(np.int32)
    batch = (jnp.asarray(window[:, :-1]), jnp.asarray(window[:, 1:]))
    own = jax.tree.map(jnp.copy, lm)  # each step consumes its own parameters
    return (mpmd_step, mp.stage_blocks(lm, n)), (spmd_step, own), tx, batch


class Updating:
    """A training loop's step as a contender: each call updates and keeps the new state."""

    def __init__(self, step, params, tx, batch):
        self.step, self.params, self.state, self.batch = step, params, tx.init(params), batch

    def __call__(self):
        loss, self.params, self.state = self.step.update(self.params, self.state, *self.batch)
        return loss


def release_cost(owner, args: tuple, rounds: int) -> float:
    """Issue CPU seconds per step spent releasing buffers after their last use: the plan run as it
    is against the same plan keeping every buffer to the end (interleaved rounds, the least of each:
    the difference of two CPU times is within the noise of their medians on a shared machine)."""
    import dataclasses

    from spectrax_mpmd._api.entry import cached_entry, fresh_inputs
    from spectrax_mpmd._runtime.plan import Step

    entry, leaves = cached_entry(owner, args)
    kept = dataclasses.replace(entry.plan, issued=[Step(fn, i, o) for fn, i, o, _ in entry.plan.hot_steps])
    inputs = fresh_inputs(entry, owner.placer, leaves)
    plans, placed = {"freed": entry.plan, "kept": kept}, {}

    def place(name):
        placed["inputs"] = jax.block_until_ready(inputs())

    def release(name, buf):  # wait for what the plan issued, untimed
        jax.block_until_ready([b for b in buf if b is not None and not b.is_deleted()])

    runs = {name: (lambda plan=plan: plan.run(placed.pop("inputs"))) for name, plan in plans.items()}
    _, cpu = interleaved(runs, rounds, setup=place, after=release, wait=None)
    return min(cpu["freed"]) - min(cpu["kept"])


def section_lm(rounds: int, configs: list) -> list:
    rows = []
    for name in configs:
        d_model, blocks, per_rank, sequences = LM_CONFIGS[name]
        (mpmd_step, staged), (spmd_step, lm), tx, batch = lm_steps(d_model, blocks, per_rank, sequences)
        spmd, mpmd = Updating(spmd_step, lm, tx, batch), Updating(mpmd_step, staged, tx, batch)
        spmd_first, spmd_first_cpu = first_call_cpu(spmd)
        mpmd_first, mpmd_first_cpu = first_call_cpu(mpmd)
        report = mpmd_step.runner.update_step.timings()
        t = timed({"mpmd": mpmd, "spmd": spmd}, rounds, 2)
        host = mpmd_step.runner.update_step.profile(mpmd.params, mpmd.state, None, *batch, rounds=rounds)
        kinds = {}
        for row in host.rows:
            if row.kind in ("F", "B", "FB"):
                calls, us = kinds.get(row.kind, (0, 0.0))
                kinds[row.kind] = (calls + row.calls, us + row.call_us)
        cell_call_us = sum(us for _, us in kinds.values()) / sum(calls for calls, _ in kinds.values())
        owner = mpmd_step.runner.update_step
        release_us = release_cost(owner, (mpmd.params, mpmd.state, None, *batch), rounds) * 1e6
        row = {
            "section": "lm",
            "config": name,
            "d_model": d_model,
            "blocks": blocks,
            "devices_per_rank": per_rank,
            "sequences": sequences,
            **{f"{k}_{stat}": v for k, s in t.items() for stat, v in s.items()},
            "vs_spmd_median": t["mpmd"]["median_ms"] / t["spmd"]["median_ms"],
            "vs_spmd_min": t["mpmd"]["min_ms"] / t["spmd"]["min_ms"],
            "issue_us_per_cell": host.per_cell_us,
            "call_us_per_cell": t["mpmd"]["cpu_median_ms"] * 1e3 / host.cells,
            "around_plan_us_per_cell": t["mpmd"]["cpu_median_ms"] * 1e3 / host.cells - host.per_cell_us,
            "release_us_per_cell": release_us / host.cells,
            "calls_us_per_cell": host.calls_per_cell_us,
            "issue_vs_calls": ratio(host.per_cell_us, host.calls_per_cell_us),
            "cell_call_us": cell_call_us,
            "issue_vs_cell_call": ratio(host.per_cell_us, cell_call_us),
            **{f"{k}_us_per_call": us / calls for k, (calls, us) in kinds.items()},
            "issue_share": host.issue_share,
            "first_s": mpmd_first,
            "spmd_first_s": spmd_first,
            "first_vs_spmd": mpmd_first / spmd_first,
            "first_cpu_s": mpmd_first_cpu,
            "spmd_first_cpu_s": spmd_first_cpu,
            "first_cpu_vs_spmd": ratio(mpmd_first_cpu, spmd_first_cpu),
            "compiled": report["compiled"],
            "relocated": report["relocated"],
            "lowered": report["lowered"],
            **{f"{k}_s": v for k, v in report["seconds"].items()},
            "host": host.as_dict(),
        }
        rows.append(row)
        print_row(LM_COLUMNS, row)
        print(host.table())
    return rows


# --- printing ----------------------------------------------------------------------------------

SCHEDULE_COLUMNS = [
    ("size", "size", "6"),
    ("schedule", "schedule", "20"),
    ("mpmd_min_ms", "mpmd min", "9.2f"),
    ("mpmd_median_ms", "mpmd med", "9.2f"),
    ("mpmd_spread", "spread", "7.2f"),
    ("mpmd_cpu_median_ms", "mpmd cpu", "9.2f"),
    ("scan_median_ms", "scan med", "9.2f"),
    ("unsplit_median_ms", "unspl med", "9.2f"),
    ("vs_scan_min", "/scan min", "9.2f"),
    ("vs_scan_median", "/scan med", "9.2f"),
    ("vs_unsplit_median", "/unspl", "7.2f"),
    ("around_plan_us_per_cell", "args/cell", "10.1f"),
    ("issue_us_per_cell", "us/cell", "8.1f"),
    ("release_us_per_cell", "free/cell", "10.1f"),
    ("issue_share", "issuing", "8.0%"),
    ("sxlib_vs_scan_median", "sx/scan", "8.2f"),
]
SCALING_COLUMNS = [
    ("n", "n", "3"),
    ("m", "m", "3"),
    ("mpmd_min_ms", "mpmd min", "9.2f"),
    ("mpmd_median_ms", "mpmd med", "9.2f"),
    ("mpmd_spread", "spread", "7.2f"),
    ("mpmd_cpu_median_ms", "mpmd cpu", "9.2f"),
    ("scan_median_ms", "scan med", "9.2f"),
    ("vs_scan_min", "/scan min", "9.2f"),
    ("vs_scan_median", "/scan med", "9.2f"),
    ("around_plan_us_per_cell", "args/cell", "10.1f"),
    ("issue_us_per_cell", "us/cell", "8.1f"),
    ("release_us_per_cell", "free/cell", "10.1f"),
    ("issue_share", "issuing", "8.0%"),
]
FIRST_COLUMNS = [
    ("config", "config", "18"),
    ("first_s", "first s", "8.2f"),
    ("unsplit_first_s", "unspl s", "8.2f"),
    ("vs_unsplit", "x unspl", "8.2f"),
    ("compiled", "compiled", "8"),
    ("relocated", "reloc", "6"),
    ("trace_s", "trace", "7.3f"),
    ("split_s", "split", "7.3f"),
    ("lower_s", "lower", "7.3f"),
    ("compile_s", "compile", "8.3f"),
    ("relocate_s", "reloc s", "8.3f"),
    ("plan_s", "plan", "7.3f"),
    ("first_run_s", "run", "7.3f"),
]
LM_COLUMNS = [
    ("config", "config", "9"),
    ("mpmd_min_ms", "mpmd min", "9.1f"),
    ("mpmd_median_ms", "mpmd med", "9.1f"),
    ("mpmd_spread", "spread", "7.2f"),
    ("mpmd_cpu_median_ms", "mpmd cpu", "9.1f"),
    ("spmd_median_ms", "unspl med", "9.1f"),
    ("vs_spmd_min", "/unspl min", "10.2f"),
    ("vs_spmd_median", "/unspl med", "10.2f"),
    ("call_us_per_cell", "call/cell", "10.1f"),
    ("around_plan_us_per_cell", "args/cell", "10.1f"),
    ("issue_us_per_cell", "us/cell", "8.1f"),
    ("release_us_per_cell", "free/cell", "10.1f"),
    ("calls_us_per_cell", "calls/cell", "10.1f"),
    ("issue_vs_calls", "x calls", "8.2f"),
    ("cell_call_us", "cell call", "10.1f"),
    ("issue_vs_cell_call", "x cell", "7.2f"),
    ("F_us_per_call", "F us", "7.1f"),
    ("B_us_per_call", "B us", "7.1f"),
    ("FB_us_per_call", "FB us", "7.1f"),
    ("first_s", "first s", "8.2f"),
    ("spmd_first_s", "unspl s", "8.2f"),
    ("first_vs_spmd", "x unspl", "8.2f"),
    ("first_cpu_s", "first cpu", "10.2f"),
    ("spmd_first_cpu_s", "unspl cpu", "10.2f"),
    ("first_cpu_vs_spmd", "x cpu", "6.2f"),
    ("lowered", "lowered", "8"),
    ("compiled", "compiled", "8"),
    ("relocated", "reloc", "6"),
    ("lower_s", "lower", "7.2f"),
    ("compile_s", "compile", "8.2f"),
]


def print_row(columns, row) -> None:
    if not getattr(print_row, "headed", None) == id(columns):
        print()
        print(" ".join(format(title, ">" + spec.split(".")[0].rstrip("f%")) for _, title, spec in columns))
        print_row.headed = id(columns)
    cells = []
    for key, _, spec in columns:
        value = row.get(key)
        width = ">" + spec.split(".")[0].rstrip("f%")
        cells.append(format("n/a", width) if value is None else format(value, ">" + spec))
    print(" ".join(cells), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per figure (default 7)")
    ap.add_argument("--sections", default="schedules,scaling,first,host,lm")
    ap.add_argument("--lm-configs", default="lm,lm-large", help="LM configurations of the lm section")
    ap.add_argument("--sizes", default="small,large", help="model sizes of the schedules section")
    ap.add_argument(
        "--first-repeats", type=int, default=3, help="fresh builds per first-call figure (min kept)"
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "mpmd_overhead.json"))
    args = ap.parse_args()
    sections = args.sections.split(",")
    rows = []
    if "host" in sections:
        rows += section_host(args.rounds)
    if "first" in sections:
        rows += section_first(args.first_repeats)
    if "schedules" in sections:
        from _sxlib import load

        rows += section_schedules(args.rounds, args.sizes.split(","), load(8, 4))
    if "scaling" in sections:
        rows += section_scaling(args.rounds)
    if "lm" in sections:
        rows += section_lm(args.rounds, args.lm_configs.split(","))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
