"""Which pipeline schedule fits in memory, and which is fastest? The advisor on the main job's model.

Profiles the byte-level transformer LM that `examples/train_lm.py` trains (same
model, smaller by default), cut into stages for `--ranks` pipeline ranks, and
prints the advisor's table: every valid (schedule, microbatches, virtual
stages) with its predicted step time, bubble and peak bytes per rank, under two
memory budgets per device. Costs come from the compiled cells and a short
timed run; peak bytes follow the runtime's issue order. Without an accelerator
the script runs on 8 fake CPU devices.

    python examples/advise.py                          # 4 ranks, budgets chosen from the table
    python examples/advise.py --layers 8 --virtual-stages 1 2   # interleaved and DualPipeV too
    python examples/advise.py --budgets-mib 0.8 1.5 --microbatches 4 8
    python examples/advise.py --d-model 256 --layers 16 --seq 256 --optimizer-states 2

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
    p.add_argument("--schedules", nargs="+", default=[c.__name__ for c in schedules.ALL_SCHEDULES])
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument(
        "--layers", type=int, default=4, help="transformer blocks (at least ranks x virtual stages)"
    )
    p.add_argument("--remat", action="store_true", help="recompute forwards in the backward")
    p.add_argument(
        "--optimizer-states",
        type=float,
        default=None,
        help="estimate the optimizer state as this many copies of the parameters (default: AdamW's own)",
    )
    p.add_argument(
        "--budgets-mib",
        type=float,
        nargs=2,
        default=None,
        help="two memory budgets per device in MiB (default: the smallest peak any configuration needs, and "
        "the median configuration's)",
    )
    p.add_argument("--json", default=None, help="write both tables as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    unknown = [s for s in args.schedules if not hasattr(schedules, s)]
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
    start = time.perf_counter()
    advice = mp.advise(
        cut,
        mesh=mesh,
        schedules=[getattr(schedules, s) for s in args.schedules],
        microbatches=args.microbatches,
        virtual_stages=args.virtual_stages,
        tx=optax.adamw(1e-3) if args.optimizer_states is None else None,
        optimizer_states=args.optimizer_states,
        remat=args.remat,
    )
    print(
        f"profiled and simulated {len(advice.candidates)} configurations in {time.perf_counter() - start:.1f} s "
        f"({advice.profiles} profiled steps)"
    )
    if args.budgets_mib is not None:
        budgets = [int(b * MIB) for b in args.budgets_mib]
    else:
        peaks = sorted(max(c.peak_bytes) for c in advice.candidates)
        budgets = [peaks[0], peaks[len(peaks) // 2]]
    report = {}
    for budget in budgets:
        ranked = advice.under(budget)
        print()
        print(ranked.table())
        best = ranked.fitting[0] if ranked.fitting else None
        if best is not None:
            print(
                f"-> {best.name}(microbatches={best.microbatches}), v={best.virtual_stages}: "
                f"{best.step_s * 1e3:.2f} ms per step predicted, peak {max(best.peak_bytes) / MIB:.3f} MiB"
            )
        report[str(budget)] = ranked.as_dict()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
