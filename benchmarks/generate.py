"""Pipelined generation: host issue CPU for g = 1, n, 2n groups; simulated rank utilisation
(whole run and steady state) from measured cell costs, for the even and the decode-aware split;
tokens/s pipelined vs unsplit.

The model is the main job's LM (byte vocabulary, d_model 128, `--layers` blocks, 4 heads), on
`--ranks` pipeline ranks, a batch of `--batch` prompts of 8 tokens, `--tokens` new greedy
tokens each. Rows (interleaved rounds, min / median / spread of wall time, the issuing
thread's CPU time next to it):
  pipelined g=1, g=n, g=2n   `PipelineDecoder.generate(..., groups=g)`, even split
  unsplit                    `spectrax_core.models.generate` on one device
A cell is one rank's step of one group's token; host CPU per cell is the issuing thread's CPU
per call over tokens x groups x stages, per generated token per rank over tokens x batch x ranks.

Utilisation: one run with `record=` at g = 2n waits for every cell and gives each stage's cost
(median over the decode rounds) and the transfer time to the next rank; the wavefront model
(`simulate_wavefront`) replays them for g = 1, n, 2n: utilisation over the whole run and in
steady state (the window where every rank has work). With more blocks than ranks,
`decode_split` picks the decode-aware split and the same figures are measured for it. On one
CPU host the fake devices share the cores, so wall time cannot show a pipeline speed-up here;
the figures are overhead and the modelled overlap.

`--model step` measures the same rows for `StepDecoder` over the same LM written as a user's
plain-JAX decode step (`_step_lm`), against that step run unsplit on one device (prefill, then
one token a call), results in `benchmarks/results/generate_step_<layers>.json`.

    python benchmarks/generate.py [--rounds 5] [--layers 4] [--model lm|step] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import _step_lm  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.models import TransformerLM, generate  # noqa: E402
from spectrax_mpmd._facade.generate.simulate import simulate_wavefront  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=4, help="blocks (the main job's LM has 4)")
    p.add_argument("--model", choices=("lm", "step"), default="lm", help="PipelineDecoder or StepDecoder")
    p.add_argument("--out", default=None, help="default: benchmarks/results/generate[_step_<layers>].json")
    return p.parse_args()


def timeline(decoder, prompt, tokens: int, groups: int, n_stages: int) -> dict:
    """One run waiting for every cell: each stage's median cell seconds over the decode rounds and the
    median transfer seconds to the next rank."""
    record: list = []
    decoder.generate(prompt, tokens, groups=groups, record=record)
    decode = [cell for cell in record if cell[3] > 0]
    cost = [
        statistics.median(end - got for _, s, _, _, _, got, end in decode if s == k) for k in range(n_stages)
    ]
    comm = statistics.median(got - start for _, s, _, _, start, got, _ in decode if s > 0)
    return {"stage_cost_s": cost, "transfer_s": comm}


def utilisation(cost, comm, group_counts, steps) -> dict:
    out = {}
    for g in group_counts:
        sim = simulate_wavefront(cost, g, steps, comm=comm)
        out[g] = {
            "whole_run": sim.utilisation,
            "steady": sim.steady,
            "busiest_rank": max(sim.busy) / sim.makespan,
        }
        print(f"  g={g}: whole run {sim.utilisation:.3f}, steady state {sim.steady:.3f}, "
              f"busiest rank {max(sim.busy) / sim.makespan:.3f}")  # fmt: skip
    return out


def modelled(name, decoder, prompt, steps, n, group_counts) -> dict:
    """The record run of `decoder` at g = 2n and the utilisation it gives."""
    line = timeline(decoder, prompt, steps, 2 * n, n)
    print(
        f"{name}: stage cell costs (us) "
        + ", ".join(f"{c * 1e6:.0f}" for c in line["stage_cost_s"])
        + f"; transfer {line['transfer_s'] * 1e6:.0f}"
    )
    line["utilisation"] = utilisation(line["stage_cost_s"], line["transfer_s"], group_counts, steps)
    return line


def models(args, mesh, prompt):
    """`(decoder, unsplit generation, lm or None)` for `--model`."""
    if args.model == "step":
        params, make = _step_lm.init_params(jax.random.key(0), args.layers), _step_lm.init_cache(args.layers)
        step = _step_lm.decode_step(args.layers, args.ranks)
        decoder = mp.StepDecoder(step, params, make, mesh=mesh)
        one = jax.jit(_step_lm.decode_step(args.layers, 1), donate_argnums=1)
        batch, length = prompt.shape
        return (
            decoder,
            lambda: _step_lm.unsplit_generate(
                one, params, make(batch, length + args.tokens), prompt, args.tokens
            ),
            None,
        )
    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=256, d_model=128, n_layers=args.layers, n_heads=4, d_ff=512
    )
    return mp.PipelineDecoder(lm, mesh=mesh), lambda: generate(lm, prompt, args.tokens), lm


def main() -> dict:
    args = parse()
    n, batch, steps = args.ranks, args.batch, args.tokens
    prompt = jax.random.randint(jax.random.key(1), (batch, 8), 0, 256)
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    decoder, unsplit, lm = models(args, mesh, prompt)
    group_counts = sorted({1, n, 2 * n} & {g for g in range(1, batch + 1) if batch % g == 0})
    want = np.asarray(unsplit())
    sides = {
        f"pipelined g={g}": (lambda g=g: decoder.generate(prompt, steps, groups=g)) for g in group_counts
    }
    sides["unsplit"] = unsplit
    for name, fn in sides.items():  # warm up (compile) and check every side gives the same tokens
        assert np.array_equal(np.asarray(fn()), want), name

    wall, cpu = interleaved(sides, args.rounds)
    rows = {k: summary(wall[k], cpu[k]) for k in sides}
    print(f"{n} ranks, batch {batch}, {steps} new tokens, {args.rounds} interleaved rounds")
    print(f"{'side':16s} {'wall min ms':>11s} {'median':>8s} {'spread':>7s} {'cpu median ms':>13s} "
          f"{'tokens/s':>9s} {'cpu/cell us':>11s} {'cpu/token/rank us':>17s}")  # fmt: skip
    for name, row in rows.items():
        cells = steps * (int(name.split("=")[1]) * n if name != "unsplit" else 1)
        row["tokens_per_s"] = batch * steps / (row["median_ms"] / 1e3)
        row["cpu_per_cell_us"] = row["cpu_median_ms"] * 1e3 / cells
        row["cpu_per_token_per_rank_us"] = (
            row["cpu_median_ms"] * 1e3 / (batch * steps * (n if name != "unsplit" else 1))
        )
        print(f"{name:16s} {row['min_ms']:11.2f} {row['median_ms']:8.2f} {row['spread']:7.2f} "
              f"{row['cpu_median_ms']:13.2f} {row['tokens_per_s']:9.0f} {row['cpu_per_cell_us']:11.1f} "
              f"{row['cpu_per_token_per_rank_us']:17.1f}")  # fmt: skip

    even = decoder.lm.blocks.sizes if lm is not None else "at the step's markers"
    splits = {"even": modelled(f"even split {even}", decoder, prompt, steps, n, group_counts)}
    if args.layers > n and lm is not None:
        split = mp.decode_split(lm, mesh=mesh, group_size=batch // (2 * n), max_len=prompt.shape[1] + steps)
        tuned = mp.PipelineDecoder(lm, mesh=mesh, stage_sizes=split.sizes)
        assert np.array_equal(np.asarray(tuned.generate(prompt, steps, groups=2 * n)), want)
        splits["decode"] = modelled(f"decode split {split.sizes}", tuned, prompt, steps, n, group_counts)
        splits["decode"]["sizes"] = split.sizes
    ratio = rows[f"pipelined g={n}"]["tokens_per_s"] / rows["unsplit"]["tokens_per_s"]
    print(f"tokens/s pipelined g={n} / unsplit: {ratio:.2f}")

    report = {
        "ranks": n,
        "batch": batch,
        "tokens": steps,
        "rounds": args.rounds,
        "rows": rows,
        "layers": args.layers,
        "model": args.model,
        "splits": splits,
        "pipelined_vs_unsplit_tokens_per_s": ratio,
        "device": str(jax.devices()[0].platform),
    }
    out = Path(
        args.out
        or f"benchmarks/results/generate{'_step_' + str(args.layers) if args.model == 'step' else ''}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
