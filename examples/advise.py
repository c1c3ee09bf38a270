"""Which pipeline schedule fits in memory, and which is fastest? The advisor on the main job's model.

Profiles the byte-level transformer LM that `examples/train_lm.py` trains (same
model, smaller by default), cut into stages for `--ranks` pipeline ranks, and
asks for the fastest step under a memory budget per device: by default half of
plain Std1F1B's peak, which plain Std1F1B does not meet, so the advisor ranks
schedules, microbatch counts, virtual stages and per-stage offload and
recompute on one predicted time. It prints the advice (the pick, why, the
runner-up, the default and its cost) and its table, then builds and runs the
pick, the next fitting candidates and plain Std1F1B, and prints predicted
against measured time per candidate (each relative to plain Std1F1B, as shared
CPU cores scale every absolute time alike) and each one's measured peak.
Without an accelerator the script runs on 8 fake CPU devices.

    python examples/advise.py                          # 4 ranks, budget half of Std1F1B's peak
    python examples/advise.py --budget-fraction 0.7 --top 4
    python examples/advise.py --layers 8 --virtual-stages 1 2 --microbatches 4 8

The optimizer is AdamW (its state on each parameter's rank, its update timed) unless
`--optimizer-states k` asks for the estimate of k copies of each rank's parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # must precede importing JAX; affects the CPU backend only
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import apply, schedules  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=int, nargs="+", default=[8], help="microbatch counts to try")
    p.add_argument(
        "--virtual-stages", type=int, nargs="+", default=[1], help="stages per rank to try (e.g. 1 2)"
    )
    p.add_argument("--schedules", nargs="+", default=None, help="schedule names (default: every one shipped)")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument(
        "--layers", type=int, default=4, help="transformer blocks (at least ranks x virtual stages)"
    )
    p.add_argument(
        "--budget-fraction", type=float, default=0.5, help="budget per device, of plain Std1F1B's peak"
    )
    p.add_argument("--top", type=int, default=3, help="fitting candidates run besides the pick")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per candidate (interleaved)")
    p.add_argument(
        "--optimizer-states",
        type=float,
        default=None,
        help="estimate the optimizer state as this many copies of the parameters (default: AdamW's own)",
    )
    p.add_argument("--json", default=None, help="write the advice and the measurements as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    unknown = [s for s in args.schedules or () if not hasattr(schedules, s)]
    if unknown:
        raise SystemExit(
            f"unknown --schedules {unknown}; choose from {[c.__name__ for c in schedules.ALL_SCHEDULES]}"
        )
    if len(jax.devices()) < args.ranks:
        raise SystemExit(
            f"--ranks {args.ranks} needs {args.ranks} devices; this machine has {len(jax.devices())}."
        )
    mesh = mp.create_mesh((args.ranks, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[: args.ranks])
    lm = TransformerLM.init(
        jax.random.key(0),
        vocab_size=256,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=4,
        d_ff=4 * args.d_model,
    )
    data = np.frombuffer(CORPUS.read_bytes(), np.uint8)
    starts = np.random.default_rng(0).integers(0, len(data) - args.seq - 1, args.batch)
    window = np.stack([data[s : s + args.seq + 1] for s in starts]).astype(np.int32)
    tokens, targets = window[:, :-1], window[:, 1:]

    def loss(model, tokens, targets):
        return softmax_cross_entropy(apply(model, tokens), targets)

    def cut(n_stages):  # the model with its blocks cut into n_stages, as the training job cuts it
        return loss, (mp.stage_blocks(lm, n_stages), tokens, targets)

    print(
        f"profiling a {args.layers}-block d={args.d_model} LM, batch {args.batch} x {args.seq} tokens, on "
        f"{args.ranks} ranks ...",
        flush=True,
    )
    tx = optax.adamw(1e-3)
    kwargs = dict(
        mesh=mesh,
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        tx=tx if args.optimizer_states is None else None,
        optimizer_states=args.optimizer_states,
    )
    if args.schedules:
        kwargs["schedules"] = [getattr(schedules, s) for s in args.schedules]
    plain = mp.advise(cut, confirm=0, **kwargs)
    budget = int(args.budget_fraction * max(plain.default.peak_bytes))
    advice = mp.advise(cut, memory_budget=budget, **kwargs)
    print(f"\n{advice}\n\n{advice.table()}\n")
    measured = measure(advice, tx, args.top, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps({"advice": advice.as_dict(), "measured": measured}, indent=1))
    return measured


def measure(advice, tx, top: int, rounds: int) -> list[dict]:
    """Build and run the pick, the next `top` fitting candidates and plain Std1F1B (median wall time
    over interleaved rounds, and each one's measured device peak); print predicted against measured,
    each relative to plain Std1F1B."""
    chosen = [advice.best, *[c for c in advice.fitting if c is not advice.best][:top]]
    chosen += [advice.default] if advice.default not in chosen else []
    runs = []
    for c in chosen:
        step = advice.step(tx, candidate=c)  # donating, as in training: each call feeds the next
        params, *batch = advice.arguments(c)
        params = jax.tree.map(jnp.copy, params)
        state = [params, tx.init(params)]
        peak = max(step.measure_peak_bytes(*state, *batch))  # copies what it donates
        _, *state = step(*state, *batch)
        runs.append((step, state, batch, peak))
    times: list[list[float]] = [[] for _ in chosen]
    for _ in range(rounds):
        for k, (step, state, batch, _) in enumerate(runs):
            start = time.perf_counter()
            _, state[0], state[1] = jax.block_until_ready(step(*state, *batch))
            times[k].append(time.perf_counter() - start)
    medians = [float(np.median(t)) for t in times]
    base_pred, base_meas = advice.default.step_s, medians[chosen.index(advice.default)]
    print(f"{'candidate':40} {'pred ms':>8} {'ratio':>6} {'meas ms':>8} {'ratio':>6} {'peak MiB':>8} fits")
    rows = []
    for c, t, (*_, peak) in zip(chosen, medians, runs):
        fit = "yes" if peak <= advice.memory_budget else "no"
        print(
            f"{c.brief()[:40]:40} {c.step_s * 1e3:>8.2f} {c.step_s / base_pred:>6.2f} {t * 1e3:>8.2f} "
            f"{t / base_meas:>6.2f} {peak / MIB:>8.2f} {fit}"
        )
        rows.append({"candidate": c.brief(), "predicted_s": c.step_s, "measured_s": t, "peak_bytes": peak})
    return rows


if __name__ == "__main__":
    main()
