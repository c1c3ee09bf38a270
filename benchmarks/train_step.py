"""The training step with its optimizer update in one plan, against gradients then a second pass.

Model: an L-layer tanh MLP (D -> D, one layer per stage) with an MSE loss, 4
pipeline ranks of one fake CPU device each, m = 8 microbatches, Adam with the
gradients clipped to a global norm. Sections (`--sections`, all by default):

  step      small (D=256, B=64) and large (D=1024, B=256), Std1F1B and ZeroBubbleH1:
            `sxvalue_and_grad` + `StagedOptimizer.update` (two calls) against
            `sxvalue_and_grad_and_apply` (validation "sync" and "post"): wall and
            issue CPU per step, and dispatches per step (plan steps; for the two-call
            form also the optimizer's jitted calls and placements).
  simulate  the small model's measured stage costs (`profile_stages`) and measured
            update cost per rank (an unclipped Adam step's cells; the validation's cost is
            what the post-validated step's cells add): each schedule's simulated makespan
            with the update ungated (each rank right after its backward), synchronous
            (after every rank's backward and the norm's two transfers), and validated
            after the fact.
  memory    peak bytes per rank of the step with its update, donating parameters and
            optimizer state or not, next to their bytes.

Every timed figure comes from `--rounds` interleaved rounds (each round runs every
contender in turn, each call waited for): wall time min, median and spread, and the
issuing thread's CPU time. Writes every row as JSON.

    python benchmarks/train_step.py [--rounds 7] [--sections step,simulate,memory]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, once, summary  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_mpmd import _optim as staged  # noqa: E402
from spectrax_mpmd._comm import is_transfer  # noqa: E402
from spectrax_mpmd._runtime.measure import measure_peak_bytes  # noqa: E402
from spectrax_mpmd._runtime.replay import replay  # noqa: E402

SIZES = {"small": (256, 64), "large": (1024, 256)}
N, M, MAX_NORM = 4, 8, 1.0
OUT = Path(__file__).parent / "results" / "train_step.json"


def init(d: int):
    keys = jax.random.split(jax.random.key(0), N)
    return [{"w": jax.random.normal(k, (d, d)) / np.sqrt(d), "b": jnp.zeros((d,))} for k in keys]


def loss_fn(params, batch):
    x, y = batch
    for k, layer in enumerate(params):
        x = jnp.tanh(x @ layer["w"] + layer["b"])
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


def batch_of(d: int, b: int):
    return jax.random.normal(jax.random.key(1), (b, d)), jax.random.normal(jax.random.key(2), (b, d))


def mesh():
    return mp.create_mesh((N, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:N])


class TwoCalls:
    """Gradients, then `StagedOptimizer.update`, counting the optimizer's dispatches."""

    def __init__(self, schedule, tx):
        self.grad = mp.sxvalue_and_grad(loss_fn, mesh=mesh(), schedule=schedule)
        self.opt = mp.StagedOptimizer(tx, max_grad_norm=MAX_NORM)
        self.calls = 0
        program = self.opt._program  # each jitted group update / norm program, counted per call
        self.opt._program = lambda *a: self._counted(program(*a))
        for name in ("_sqrt_sum",):  # the module's jitted norm helper (clipping is in the group programs)
            setattr(staged, name, self._counted(getattr(staged, name)))

    def _counted(self, fn):
        if getattr(fn, "counted", False):
            return fn

        def call(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        call.counted = True
        return call

    def init(self, params, batch):
        _, grads = self.grad(params, batch)
        return params, self.opt.init(params, grads)

    def __call__(self, params, state, batch):
        loss, grads = self.grad(params, batch)
        params, state = self.opt.update(grads, state, params)
        return loss, params, state

    def dispatches(self, params, state, batch) -> int:
        self.calls, put = 0, jax.device_put
        count = [0]

        def counted_put(*a, **k):
            count[0] += 1
            return put(*a, **k)

        jax.device_put = counted_put
        try:
            jax.block_until_ready(self(params, state, batch))
        finally:
            jax.device_put = put
        return len(self.grad.last_plan.hot_steps) + self.calls + count[0]


class OneCall:
    def __init__(self, schedule, tx, validation):
        self.tx = tx
        self.step = mp.sxvalue_and_grad_and_apply(
            loss_fn, tx, mesh=mesh(), schedule=schedule, max_grad_norm=MAX_NORM, validation=validation
        )

    def init(self, params, batch):
        return jax.tree.map(jnp.copy, params), self.tx.init(params)

    def __call__(self, params, state, batch):
        return self.step(params, state, batch)

    def dispatches(self, params, state, batch) -> int:
        return len(self.step.last_entry.plan.hot_steps)


def timed(contenders: dict, batch, rounds: int) -> dict:
    state = {name: c.init(init(batch[0].shape[1]), batch) for name, c in contenders.items()}
    for name, c in contenders.items():  # compile and warm
        for _ in range(2):
            loss, *state[name] = c(*state[name], batch)
            jax.block_until_ready(state[name])

    def stepping(name, c):
        def one():  # a training loop's step: it keeps the new parameters and state
            _, *state[name] = c(*state[name], batch)
            return state[name]

        return one

    steps = {name: stepping(name, c) for name, c in contenders.items()}
    # the CPU figure is the step's issue: its clock stops before the wait for the new state
    wall, cpu = interleaved(steps, rounds, issue_cpu_only=True)
    return {
        name: {**summary(wall[name], cpu[name]), "dispatches": c.dispatches(*state[name], batch)}
        for name, c in contenders.items()
    }


def section_step(rounds: int) -> list[dict]:
    rows = []
    tx = optax.adam(1e-3)
    for size, (d, b) in SIZES.items():
        batch = batch_of(d, b)
        for sched_name in ("Std1F1B", "ZeroBubbleH1"):
            schedule = getattr(S, sched_name)(microbatches=M)
            contenders = {
                "two calls": TwoCalls(schedule, tx),
                "one plan (sync)": OneCall(schedule, tx, "sync"),
                "one plan (post)": OneCall(schedule, tx, "post"),
            }
            result = timed(contenders, batch, rounds)
            base = result["two calls"]
            print(f"\n{size} D={d} B={b} {sched_name}")
            print(
                f"  {'':18} {'min ms':>8} {'med ms':>8} {'spread':>7} {'cpu ms':>8} {'vs two':>7} {'disp':>5}"
            )
            for name, r in result.items():
                ratio = r["median_ms"] / base["median_ms"]
                print(
                    f"  {name:18} {r['min_ms']:8.2f} {r['median_ms']:8.2f} {r['spread']:7.2f} "
                    f"{r['cpu_median_ms']:8.2f} {ratio:7.2f} {r['dispatches']:5d}"
                )
                rows.append(
                    dict(section="step", size=size, schedule=sched_name, contender=name, ratio=ratio, **r)
                )
    return rows


def update_seconds(step, params, state, batch, rounds: int = 5) -> list[float]:
    """Per rank, the measured seconds of the update's cells (every cell after the schedule)."""
    entry = step.last_entry
    plan = entry.plan
    start = max(end for *_, end in plan.action_steps)
    best = [float("inf")] * N
    for _ in range(rounds):
        spent = [0.0] * N
        leaves = jax.tree.leaves((jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, state), batch))

        def call(k, fn, args):
            if k < start or is_transfer(fn):
                return fn(*args)
            jax.block_until_ready(args)
            result = {}

            def cell():
                result["out"] = fn(*args)
                return result["out"]

            seconds, _ = once(cell)
            out = result["out"]
            rank = plan.device_rank[next(iter(out[0].sharding.device_set))]
            spent[rank] += seconds
            return out

        replay(plan, entry.place(step.placer, leaves), call=call)
        best = [min(a, b) for a, b in zip(best, spent)]
    return best


def section_simulate(rounds: int) -> list[dict]:
    d, b = SIZES["small"]
    batch, params, tx = batch_of(d, b), init(d), optax.adam(1e-3)
    rows = []
    print("\nsimulated step with the update (small model, measured costs, µs)")
    print(
        f"  {'schedule':14} {'no update':>10} {'ungated':>10} {'sync':>10} {'post':>10} {'gain':>7} "
        f"{'post/ungated':>13}"
    )
    for sched_name in ("GPipe", "Std1F1B", "ZeroBubbleH1", "Eager1F1B"):
        schedule = getattr(S, sched_name)(microbatches=M)
        profile = mp.profile_stages(loss_fn, params, batch, mesh=mesh(), schedule=schedule, rounds=3)
        cost = profile.stage_cost()
        measured = {}
        for name, kwargs in (("plain", {}), ("post", {"max_grad_norm": MAX_NORM, "validation": "post"})):
            step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=mesh(), schedule=schedule, **kwargs)
            step(jax.tree.map(jnp.copy, params), tx.init(params), batch)
            measured[name] = update_seconds(step, params, tx.init(params), batch, rounds=rounds)
        apply = measured["plain"]
        validate = max(max(p - a, 0.0) for p, a in zip(measured["post"], apply))  # the check's cells
        timeline = S.simulate(schedule, N, cost)
        made = {
            validation: S.with_update(
                timeline, apply, validation=validation, validate=validate if validation == "post" else 0.0
            ).makespan
            for validation in S.VALIDATIONS
        }
        gain = made["sync"] / made["none"] - 1
        print(
            f"  {sched_name:14} {timeline.makespan * 1e6:10.0f} {made['none'] * 1e6:10.0f} "
            f"{made['sync'] * 1e6:10.0f} {made['post'] * 1e6:10.0f} {gain:7.1%} "
            f"{made['post'] / made['none']:13.4f}"
        )
        rows.append(
            dict(
                section="simulate",
                schedule=sched_name,
                makespan_s=timeline.makespan,
                update_s=apply,
                validate_s=validate,
                **{f"{validation}_s": v for validation, v in made.items()},
                gain=gain,
            )
        )
    return rows


def section_memory() -> list[dict]:
    d, b = SIZES["large"]
    batch, params, tx = batch_of(d, b), init(d), optax.adam(1e-3)
    schedule = S.Std1F1B(microbatches=M)
    weights = [sum(x.nbytes for x in jax.tree.leaves(layer)) for layer in params]
    rows = []
    print("\npeak bytes per rank of the step with its update (large model), MiB")
    for donate in (True, False):
        step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=mesh(), schedule=schedule, donate=donate)
        p, s = jax.tree.map(jnp.copy, params), tx.init(params)
        step(p, s, batch)
        p, s = jax.tree.map(jnp.copy, params), tx.init(params)
        leaves = jax.tree.leaves((p, s, batch))
        peaks = measure_peak_bytes(step.last_entry.plan, step.last_entry.place(step.placer, leaves))
        print(f"  donate={donate!s:5}: " + "  ".join(f"{x / 2**20:7.2f}" for x in peaks))
        rows.append(dict(section="memory", donate=donate, peaks=list(peaks), weights=weights))
    print("  parameters:   " + "  ".join(f"{w / 2**20:7.2f}" for w in weights) + "  (Adam state: 2x)")
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sections", default="step,simulate,memory")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    rows = []
    if "step" in sections:
        rows += section_step(args.rounds)
    if "simulate" in sections:
        rows += section_simulate(args.rounds)
    if "memory" in sections:
        rows += section_memory()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
