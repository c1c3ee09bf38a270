"""Devices per stage: what the planner measures and chooses for an LM whose head makes its last stage
several times the others (about 4x on one device).

An embedding, `--blocks` residual MLP blocks (hidden width `--hidden`, sharded over `tp` by the
default rules) and a head over `--vocab` classes (also over `tp`) on 4 pipeline ranks, Std1F1B.
Each block is profiled on a rank of 1, 2 and 4 devices (`balance(devices=8)`), and the splits are
ranked under both cost models: `measured` (the seconds measured on k fake CPU devices, which share
the host's cores) and `work` (the seconds on one device scaled by the FLOPs per device). Then
each split is run on a mesh of ranks of its own sizes (`mp.create_rank_mesh`): the two even
ones (4 ranks of 1 device, 4 of 2) and each cost model's choice, their step times over
interleaved rounds and peak bytes per rank next to both models' predictions for them.
Writes benchmarks/results/planner_devices.json.

    python benchmarks/planner_devices.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core import sharding as sh  # noqa: E402
from spectrax_mpmd._planner.block_costs import profile_blocks  # noqa: E402
from spectrax_mpmd._planner.device_advice import balance_devices, simulated  # noqa: E402
from spectrax_mpmd._planner.devices import Split  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "planner_devices.json"
RULES = sh.Rules.default()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    """One weight whose logical axes the rules resolve against each rank's submesh."""

    w: jax.Array
    axes: tuple = dataclasses.field(metadata={"static": True})

    def logical_axes(self):
        return {"w": self.axes}


def model(args):
    """`(params, tokens, targets)`: an embedding, MLP blocks and a head."""
    keys = iter(jax.random.split(jax.random.key(0), 2 * args.blocks + 4))
    d, h = args.d, args.hidden

    def dense(shape, axes):
        return Dense(jax.random.normal(next(keys), shape) / np.sqrt(shape[0]), axes)

    params = {
        "embed": jax.random.normal(next(keys), (args.vocab, d)) / 4,
        "blocks": [
            (dense((d, h), ("EMBED", "MLP")), dense((h, d), ("MLP", "EMBED"))) for _ in range(args.blocks)
        ],
        "head": dense((d, args.vocab), ("EMBED", "VOCAB")),
    }
    tokens = jax.random.randint(next(keys), (args.batch, args.length), 0, args.vocab)
    return params, tokens, jnp.roll(tokens, -1, axis=1)


def cut(sizes):
    """The loss with a marker after each of `sizes`' stages (block counts): the embedding on the
    first stage, the head and its loss on the last."""
    ends = set(np.cumsum(sizes)[:-1].tolist())

    def loss(params, tokens, targets):
        x = params["embed"][tokens]
        for i, (w1, w2) in enumerate(params["blocks"]):
            x = x + jnp.tanh(x @ w1.w) @ w2.w
            if i + 1 in ends:
                x = mp.sxstage_iter(x)
        logp = jax.nn.log_softmax(x @ params["head"].w)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

    return loss


def plan_row(plan) -> dict:
    return {
        "blocks": list(plan.split.blocks),
        "devices": list(plan.split.devices),
        "predicted_step_ms": plan.step_s * 1e3,
        "predicted_peak_mib": [p / 2**20 for p in plan.peak_bytes],
    }


def advised(costs, schedule, model_name: str) -> dict:
    result = balance_devices(costs, schedule, 4, 8, cost_model=model_name)
    print(result.table())
    return {
        "plans": {p.label.replace(" ", "_"): plan_row(p) for p in result.candidates},
        "heavy_stage": result.heavy_stage,
        "heavy_ms": {str(k): [v * 1e3 for v in pair] for k, pair in result.heavy_s.items()},
    }


def rank_mesh(devices: tuple[int, ...]):
    """Pipeline ranks of `devices[r]` devices each along `tp` (the rules' MLP and VOCAB axis)."""
    axes = [{"dp": 1, "fsdp": 1, "ep": 1, "tp": k, "sp": 1} for k in devices]
    return mp.create_rank_mesh(axes, devices=jax.devices()[: sum(devices)])


def runs(costs, schedule, params_batch, args, chosen: dict) -> dict:
    """Each split run on its own rank mesh (the even ones, 4 ranks of 1 device and of 2, and each
    cost model's choice, `chosen[name]`): step time over interleaved rounds and peak bytes per
    rank, next to what both cost models predict for it."""
    even = mp.stage_sizes(args.blocks, 4)
    splits = {"even_1": Split(even, (1,) * 4), "even_2": Split(even, (2,) * 4)}
    splits |= {f"chosen_{name}": split for name, split in chosen.items()}
    steps, rows = {}, {}
    for name, split in splits.items():
        mesh = rank_mesh(split.devices)
        step = mp.sxvalue_and_grad(cut(split.blocks), mesh=mesh, schedule=schedule, rules=RULES)
        step(*params_batch)
        steps[name] = lambda step=step: step(*params_batch)
        rows[name] = {
            "blocks": list(split.blocks),
            "devices": list(split.devices),
            "peak_mib": [p / 2**20 for p in step.measure_peak_bytes(*params_batch)],
            "predicted": {
                model: plan_row(simulated(costs, schedule, name, split, model, None, 0.0))
                for model in ("measured", "work")
            },
        }
    wall, cpu = interleaved(steps, args.rounds)
    for name in steps:
        rows[name].update(summary(wall[name], cpu[name]))
        print(name, rows[name])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=64, help="model width")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of every block")
    p.add_argument("--vocab", type=int, default=1536, help="the head's classes (the last stage's weight)")
    p.add_argument("--blocks", type=int, default=4, help="blocks (one per stage)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5, help="profile rounds and timed step rounds")
    args = p.parse_args()
    schedule = S.Std1F1B(microbatches=4)
    params_batch = model(args)
    mesh = mp.create_mesh((1, 1, 1, 1, 8, 1), mpmd_axis="pp")
    on = {"sizes": (1, 2, 4), "axis": "tp"}
    settings = mp.StepSettings("balance", mesh=mesh, schedule=schedule, rules=RULES)
    costs = profile_blocks(cut((1,) * args.blocks), params_batch, settings, args.blocks, on, args.rounds)
    advice = {name: advised(costs, schedule, name) for name in ("measured", "work")}
    chosen = {
        name: Split(*(tuple(a["plans"]["chosen"][k]) for k in ("blocks", "devices")))
        for name, a in advice.items()
    }
    result = {
        "config": vars(args),
        "block_ms": {str(k): [t * 1e3 for t in v] for k, v in costs.seconds("measured").items()},
        "advice": advice,
        "runs": runs(costs, schedule, params_batch, args, chosen),
    }
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
