"""Offload and per-stage recompute: device and host peak bytes per rank, predicted and measured, and
the step time they cost; then `mp.advise` under a budget plain 1F1B does not fit.

The main job's model (TransformerLM, vocab 256, d=128, 4 layers, d_ff 512) on 4 pipeline ranks,
batch 32 x 64 tokens, 8 microbatches. For each contender (Std1F1B and ZeroBubbleH1, keeping
residuals, offloading all of them, half of their bytes, recomputing, a checkpoint policy, and a
per-stage mix) the peaks are predicted by the planner's memory model from the profiles of two other
steps (keeping residuals, recomputing; neither offloads) and measured on the step itself
(`measure_peak_bytes_by_kind`). Step times: `--rounds` interleaved rounds of `--calls` calls each,
waited for: wall min, median, spread and the issuing thread's CPU time. The advisor's pick is run
the same way and its predicted step time set beside the measured one. Writes
benchmarks/results/offload.json.

    python benchmarks/offload.py [--rounds 5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import apply  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402
from spectrax_mpmd._planner.backend import copy_fits  # noqa: E402
from spectrax_mpmd._planner.memory import chosen_memory  # noqa: E402
from spectrax_mpmd._trace.policy import stage_offload, stage_remat  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "offload.json"
N, M, BATCH, SEQ = 4, 8, 32, 64
CHOICES = {  # name -> (remat, offload)
    "keep": (False, False),
    "offload all": (False, True),
    "offload half": (False, 0.5),
    "recompute": (True, False),
    "dots_saveable": ("dots_saveable", False),
    "mixed": ((False, "dots_saveable", True, False), (True, 0.5, False, False)),
}


def problem():
    lm = TransformerLM.init(jax.random.key(0), vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    params = mp.stage_blocks(lm, N)
    k1, k2 = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(k1, (BATCH, SEQ), 0, 256)
    targets = jax.random.randint(k2, (BATCH, SEQ), 0, 256)
    return params, tokens, targets


def loss(params, tokens, targets):
    return softmax_cross_entropy(apply(params, tokens), targets)


def timed(contenders: dict, args, mesh_args) -> dict:
    """Interleaved rounds of `args.calls` waited-for calls of each contender."""
    for step in contenders.values():
        jax.block_until_ready(step(*mesh_args))
    calls = {name: (lambda step=step: step(*mesh_args)) for name, step in contenders.items()}
    wall, cpu = interleaved(calls, args.rounds, args.calls)
    return {k: summary(wall[k], cpu[k]) for k in contenders}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    mesh = mp.create_mesh((N, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:N])
    call_args = problem()
    out, back, issue = copy_fits(jax.devices()[0], (1 << 12, 1 << 16, 1 << 20, 1 << 22))
    bandwidth = out.bandwidth
    print(
        f"device -> host copy: {out.fixed_s * 1e6:.0f} us + bytes at {out.bandwidth / 1e9:.2f} GB/s; back: "
        f"{back.fixed_s * 1e6:.0f} us + {back.bandwidth / 1e9:.2f} GB/s; "
        f"issuing thread {issue * 1e6:.0f} us a copy"
    )
    rows, steps = [], {}
    for schedule in (S.Std1F1B(microbatches=M), S.ZeroBubbleH1(microbatches=M)):
        stages = schedule.num_model_stages(N)

        def step_of(remat, offload):
            return mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule, remat=remat, offload=offload)

        profiles = {r: step_of(r, False).profile_stages(*call_args, rounds=0) for r in (False, True)}
        for name, (remat, offload) in CHOICES.items():
            step = steps[f"{type(schedule).__name__} {name}"] = step_of(remat, offload)
            measured = step.measure_peak_bytes_by_kind(*call_args)
            row = {"schedule": type(schedule).__name__, "choice": name, "measured": measured}
            if all(r in (False, True) for r in stage_remat(remat, stages)):
                memory = chosen_memory(profiles, stage_remat(remat, stages), stage_offload(offload, stages))
                timeline = S.simulate(schedule, N, memory=memory)
                row["predicted"] = {"device": timeline.peak_bytes, "host": timeline.peak_host_bytes}
            rows.append(row)
    times = timed(steps, args, call_args)
    print(
        f"{'schedule':13} {'choice':14} {'device MiB per rank (measured; predicted error)':58} "
        f"{'host MiB':24} ms"
    )
    for row in rows:
        name = f"{row['schedule']} {row['choice']}"
        row["time"] = timing = times[name]
        dev, host = row["measured"]["device"], row["measured"]["host"]
        pred = row.get("predicted")
        err = (
            max(
                abs(p - m) / max(m, 1)
                for kind in ("device", "host")
                for p, m in zip(pred[kind], row["measured"][kind])
            )
            if pred
            else None
        )
        row["max_error"] = err
        cells = " ".join(f"{b / 2**20:6.3f}" for b in dev)
        note = "n/a (policy)" if err is None else f"{err:.1%}"
        print(
            f"{row['schedule']:13} {row['choice']:14} {cells}  err {note:12} "
            f"{' '.join(f'{b / 2**20:5.2f}' for b in host):24} "
            f"{timing['median_ms']:7.1f} (min {timing['min_ms']:.1f}, spread {timing['spread']:.0%}, "
            f"cpu {timing['cpu_median_ms']:.1f})"
        )
    advised = advise(mesh, call_args, rows, args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = {"bandwidth": bandwidth, "rows": rows, "advise": advised}
    OUT.write_text(json.dumps(result, indent=1, default=list))
    print(f"wrote {OUT}")
    return result


def advise(mesh, call_args, rows, args) -> dict:
    """`mp.advise` (Std1F1B, ZeroBubbleH1; m=8) under 60% of plain 1F1B's largest peak with Adam's
    state: its pick, and that pick's predicted and measured step time (the whole training step)."""
    tx = optax.adam(1e-3)
    kwargs = dict(mesh=mesh, schedules=(S.Std1F1B, S.ZeroBubbleH1), microbatches=(M,), virtual_stages=(1,))
    plain = mp.advise(loss, *call_args, tx=tx, rounds=2, search=False, **kwargs)
    f1b = next(c for c in plain.candidates if c.name == "Std1F1B")
    budget = int(0.6 * max(f1b.peak_bytes))
    advice = mp.advise(loss, *call_args, tx=tx, rounds=2, search=False, memory_budget=budget, **kwargs)
    print(advice.table())
    best = advice.best
    params, *batch = advice.arguments()
    state = tx.init(params)
    copies = jax.tree.map(lambda x: x.copy(), (params, state))  # the measured step consumes its copies
    measured_peaks = advice.step().measure_peak_bytes(*copies, *batch)
    times = timed({"advised": advice.step(donate=False)}, args, (params, state, *batch))["advised"]
    print(
        f"advised {best.name} under {budget / 2**20:.3f} MiB: predicted step {best.step_s * 1e3:.1f} ms, "
        f"measured median {times['median_ms']:.1f} ms "
        f"(ratio {times['median_ms'] / (best.step_s * 1e3):.2f}); "
        f"peak MiB predicted {max(best.peak_bytes) / 2**20:.3f}, measured {max(measured_peaks) / 2**20:.3f}"
    )
    return {
        "budget": budget,
        "plain_1f1b_peak": max(f1b.peak_bytes),
        "schedule": best.name,
        "choice": None if best.memory is None else best.memory.as_dict(),
        "predicted_step_s": best.step_s,
        "measured": times,
        "predicted_peaks": best.peak_bytes,
        "measured_peaks": measured_peaks,
    }


if __name__ == "__main__":
    main()
