"""What comparing the arguments of every call across processes costs a training step.

The main job's model and step (examples/train_lm.py's defaults: a byte-level TransformerLM,
d_model 128, 4 blocks, AdamW, batches of 32 x 64 tokens as NumPy arrays, 4 ranks, Std1F1B with
8 microbatches) run as a job of 2 processes with 2 CPU devices each, two ranks per process.
Two copies of the step run interleaved over `--rounds` rounds of `--calls` steps: one with the
default check (`SPECTRAX_MPMD_CHECK_INPUTS=host`: every call compares the arguments' structure,
shapes and dtypes and the CRC-32 of the host batch through the key-value store), one with the
check at each signature's first call only (`first`). Next to them, the check itself is timed
alone on the `host` step's arguments, as each of its calls runs it (wall and issuing-thread
CPU time per call; the call's signature, which every call computes anyway, left out). Reported per process:
the step's min and median wall time (and spread) for each, the check's median µs per call,
and the check's share of the `host` step.

    python benchmarks/input_check.py [--rounds 5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import interleaved, summary

BATCH, SEQ, D_MODEL, LAYERS, RANKS, M = 32, 64, 128, 4, 4, 8


def _barrier() -> None:
    from spectrax_mpmd._comm import Exchange

    _barrier.exchange = getattr(_barrier, "exchange", None) or Exchange("benchmark-barrier")
    _barrier.exchange.allgather("")


def worker(out: str, rounds: int, calls: int) -> None:
    import spectrax_mpmd as mp

    mp.initialize()
    import jax
    import numpy as np
    import optax

    from spectrax_core import schedules as S
    from spectrax_core.losses import softmax_cross_entropy
    from spectrax_core.models import TransformerLM
    from spectrax_mpmd._trace.args import signature

    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=256, d_model=D_MODEL, n_layers=LAYERS, n_heads=4, d_ff=4 * D_MODEL
    )
    rng = np.random.default_rng(0)
    window = rng.integers(0, 256, (BATCH, SEQ + 1)).astype(np.int32)
    tokens, targets = window[:, :-1], window[:, 1:]
    mesh = mp.create_mesh((RANKS, 1, 1, 1, 1, 1), mpmd_axis="pp")
    tx = optax.adamw(3e-3)
    steps, states = {}, {}
    for mode in ("host", "first"):  # each step reads the setting at its first call
        os.environ["SPECTRAX_MPMD_CHECK_INPUTS"] = mode
        steps[mode] = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(microbatches=M), tx=tx)
        params = jax.tree.map(np.array, mp.stage_blocks(lm, RANKS))  # each step consumes its own copy
        states[mode] = [params, tx.init(params)]
        for _ in range(2):
            _update(steps[mode], states[mode], tokens, targets)

    def call(mode):
        return lambda: _update(steps[mode], states[mode], tokens, targets)

    update_step = steps["host"].runner.update_step
    check = update_step.inputs_check

    current = {}

    def setup(name):  # the check is timed on the host step's current arguments (as it runs it)
        params, state = states["host"]
        current["sig"] = signature(update_step.name, update_step.fn, (params, state, None, tokens, targets), ())
        _barrier()

    wall, cpu = interleaved(
        {"host": call("host"), "first": call("first"), "check": lambda: check(current["sig"], first=False)},
        rounds,
        calls,
        setup=setup,
    )
    result = {mode: summary(wall[mode], cpu[mode]) for mode in ("host", "first")}
    result["check"] = summary(wall["check"], cpu["check"], unit="us")
    Path(out, f"p{jax.process_index()}.json").write_text(json.dumps(result))


def _update(step, state: list, tokens, targets):
    loss, state[0], state[1] = step.update(state[0], state[1], tokens, targets)
    return loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--calls", type=int, default=5, help="steps per round (default 5)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "input_check.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.calls)
        return
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--worker", out, "--rounds", str(args.rounds), "--calls", str(args.calls)]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        launch = [sys.executable, "-m", "spectrax_mpmd.launch", "--nproc", "2", "--devices-per-proc", "2"]
        subprocess.run([*launch, *me], env=env, check=True, timeout=1200, stdout=subprocess.DEVNULL)
        procs = [json.loads(p.read_text()) for p in sorted(Path(out).glob("p*.json"))]
    print(f"main job's LM, 2 processes x 2 devices, {RANKS} ranks, Std1F1B m={M}; {args.rounds} rounds x {args.calls} steps")
    print(f"{'process':8} {'host min/median ms':>19} {'first min/median ms':>20} {'check us (CPU us)':>18} {'share':>6}")
    rows = {}
    for p, proc in enumerate(procs):
        host, first, check = proc["host"], proc["first"], proc["check"]
        share = check["median_us"] / (host["median_ms"] * 1e3)
        rows[f"p{p}"] = {**proc, "share": share}
        print(
            f"{p:<8} {host['min_ms']:8.1f} / {host['median_ms']:8.1f} {first['min_ms']:9.1f} / {first['median_ms']:8.1f} "
            f"{check['median_us']:8.0f} ({check['cpu_median_us']:5.0f}) {share:6.2%}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"processes": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
