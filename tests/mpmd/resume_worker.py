"""A training job for the save-and-resume tests: one process or every process of a launched job.

    resume_worker.py OUT CKPT --ranks R --schedule NAME --steps N [--save-at K] [--resume]

Trains a small LM on R pipeline ranks over all devices of the job with `StagedOptimizer`
(AdamW, global-norm clipping), saving at step K through `mp.CheckpointManager` (K steps done)
or, with `--resume`, restoring the latest step first onto this job's layout. After every
update each process classifies every parameter and optimizer-state leaf (held here, or a
global array without local shards; a held parameter must differ from its value before the
update). At the end `mp.gather` collects the parameters on every process. Each process
writes OUT/p<process>.json: its losses by step, the leaf counts and the gathered
parameters' sums.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import spectrax_mpmd as mp  # noqa: E402

mp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from spectrax_core import schedules  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

VOCAB, BATCH, LENGTH = 32, 8, 8


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The same batch for a step on every process and in every run."""
    tokens = np.random.default_rng(step).integers(0, VOCAB, (BATCH, LENGTH + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def leaf_kinds(tree, before=None) -> dict:
    """How many leaves this process holds, how many are global arrays without local shards here,
    and how many are neither (a partial or stale local copy) or held but unchanged since `before`."""
    counts = {"held": 0, "remote": 0, "other": 0, "unchanged": 0}
    olds = jax.tree.leaves(before) if before is not None else [None] * len(jax.tree.leaves(tree))
    for x, old in zip(jax.tree.leaves(tree), olds):
        if x.is_fully_addressable:
            counts["held"] += 1
            if (
                old is not None
                and old.is_fully_addressable
                and np.array_equal(np.asarray(x), np.asarray(old))
            ):
                counts["unchanged"] += 1
        elif not x.addressable_shards:
            counts["remote"] += 1
        else:
            counts["other"] += 1
    return counts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpt")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--schedule", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    me = jax.process_index()
    mesh = mp.create_mesh((args.ranks, 1, -1, 1, 1, 1), mpmd_axis="pp")
    lm = TransformerLM.init(jax.random.key(0), vocab_size=VOCAB, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    schedule = getattr(schedules, args.schedule)(microbatches=4)
    step_fn = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule)
    opt = mp.StagedOptimizer(optax.adamw(1e-2), max_grad_norm=1.0)
    manager = mp.CheckpointManager(args.ckpt)
    params, state, start = mp.stage_blocks(lm, args.ranks), None, 0
    if args.resume:
        like = jax.eval_shape(lambda: mp.stage_blocks(lm, args.ranks))
        shardings = mp.owner_shardings(step_fn, like, *batch(0))
        restored = manager.restore(like=like, shardings=shardings, optimizer=opt)
        params, state, start = restored.params, restored.opt_state, restored.extra["step"]
    losses, kinds = {}, []
    for s in range(start, args.steps):
        loss, grads = step_fn(params, *batch(s))
        state = opt.init(params, grads) if state is None else state
        new_params, state = opt.update(grads, state, params)
        kinds.append({"params": leaf_kinds(new_params, params), "opt_state": leaf_kinds(state.states)})
        params, losses[s] = new_params, float(loss)
        if args.save_at == s + 1:
            manager.save(s + 1, params=params, opt_state=state, extra={"step": s + 1})
    manager.close()
    gathered = mp.gather(params)
    sums = [float(np.sum(np.asarray(x, np.float64))) for x in jax.tree.leaves(gathered)]
    record = {"losses": losses, "kinds": kinds, "gathered": sums, "steps": manager.all_steps()}
    with open(os.path.join(args.out, f"p{me}.json"), "w") as f:
        json.dump(record, f)
    print(f"process {me}: done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
