"""Optimizer steps on pipelined gradients against the same update unsplit on one device.

The main job's model (TransformerLM, vocab 256, d=128, 4 layers, d_ff 512: 1.12 M
parameters) on 4 pipeline ranks (Std1F1B, m=4); AdamW with global-norm clipping at 1.0.
Contenders, each given the same gradients every round:

  unsplit       one `jax.jit` of clip + adamw + apply_updates over the unstaged model, one device
  unsplit-2dev  the same program with everything replicated on two devices: what each rank of
                `staged` computes (a rank's two devices each run the whole update; fake CPU
                devices share the cores, so it costs about twice `unsplit` here)
  staged        `mp.StagedOptimizer(adamw, max_grad_norm=1.0).update` on the pipelined
                gradients, 4 ranks x 2 devices (the main job's layout)
  staged-1dev   the same on 4 ranks x 1 device: compare with `unsplit`
  *-noclip      `unsplit` and `staged-1dev` without clipping (no norm pass)
  eager     `spx.Optimizer(model, adamw).update` on `spx.run`'s pipelined gradients (an eager
            MLP of 8 Linear(128, 128) blocks on 4 ranks), next to the same optimizer given
            gradients already on the parameters' device (`eager-local`)

For each: the first call (compiles included) and the second (a second compile shows
here), then `--rounds` interleaved rounds of `--calls` calls each, waited for: wall time
min, median and spread, and the issuing thread's CPU time. Writes
benchmarks/results/optimizer.json.

    python benchmarks/optimizer.py [--rounds 7] [--calls 10]
"""

from __future__ import annotations

import argparse
import json
import pathlib

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, once, summary  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import spectrax_core as sc  # noqa: E402
import spectrax_eager as spx  # noqa: E402
import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402
from spectrax_core.schedules import Std1F1B  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "optimizer.json"


def _lm_problem():
    lm = TransformerLM.init(jax.random.key(0), vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512)
    tokens = jax.random.randint(jax.random.key(1), (16, 32), 0, 256)
    return lm, tokens, jnp.roll(tokens, -1, axis=1)


def staged_contender(devices_per_rank: int, clip: bool = True):
    """`StagedOptimizer.update` on the pipelined gradients of 4 ranks x `devices_per_rank`."""
    lm, tokens, targets = _lm_problem()
    devices = jax.devices()[: 4 * devices_per_rank]
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp", devices=devices)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=Std1F1B(microbatches=4))
    params = mp.stage_blocks(lm, 4)
    _, grads = step(params, tokens, targets)
    staged = mp.StagedOptimizer(optax.adamw(1e-3), max_grad_norm=1.0 if clip else None)
    state = {"s": staged.init(params, grads), "p": params}

    def run_staged():
        state["p"], state["s"] = staged.update(grads, state["s"], state["p"])
        return state["p"], state["s"]

    return run_staged


def unsplit_contender(devices: int, clip: bool = True):
    """clip + adamw + apply_updates as one `jax.jit`, everything replicated on `devices` devices."""
    lm, tokens, targets = _lm_problem()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)) if clip else optax.adamw(1e-3)
    place = NamedSharding(Mesh(np.array(jax.devices()[:devices]), ("d",)), PartitionSpec())
    params = jax.device_put(lm, place)
    grads = jax.device_put(jax.grad(lambda p: softmax_cross_entropy(sc.apply(p, tokens), targets))(lm), place)

    @jax.jit
    def unsplit(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = {"s": jax.jit(tx.init)(params), "p": params}

    def run_unsplit():
        out = unsplit(grads, state["s"], state["p"])
        state["p"], state["s"] = out
        return out

    return run_unsplit


def lm_contenders() -> dict:
    return {
        "unsplit": unsplit_contender(1),
        "unsplit-2dev": unsplit_contender(2),
        "staged": staged_contender(2),
        "staged-1dev": staged_contender(1),
        "unsplit-noclip": unsplit_contender(1, clip=False),
        "staged-1dev-noclip": staged_contender(1, clip=False),
    }


class Net(spx.Module):
    def __init__(self, rngs):
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(128, 128, rngs=rngs) for _ in range(8)])

    def forward(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return x


def eager_contenders() -> dict:
    mse = lambda out, y: jnp.mean((out - y) ** 2)  # noqa: E731
    x = jax.random.normal(jax.random.key(2), (32, 128))
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")
    model, local_model = Net(spx.Rngs(0)), Net(spx.Rngs(0))
    _, grads = spx.run(model, inputs=x, targets=x, mesh=mesh, loss_fn=mse, microbatches=4)
    _, local_grads = spx.value_and_grad(lambda m: mse(m(x), x))(local_model)
    opt, local_opt = spx.Optimizer(model, optax.adamw(1e-3)), spx.Optimizer(local_model, optax.adamw(1e-3))

    def eager():
        opt.update(model, grads)
        return spx.tree_state(model)

    def eager_local():
        local_opt.update(local_model, local_grads)
        return spx.tree_state(local_model)

    return {"eager": eager, "eager-local": eager_local}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args(argv)
    contenders = {**lm_contenders(), **eager_contenders()}
    firsts = {}
    for name, fn in contenders.items():
        firsts[name] = [once(fn)[0] for _ in range(2)]
    wall, cpu = interleaved(contenders, args.rounds, args.calls)
    records = []
    print(
        f"{'contender':18} {'1st call s':>10} {'2nd ms':>8} {'min ms':>8} {'median ms':>9} {'spread':>7} "
        f"{'cpu ms':>7}"
    )
    for name in contenders:
        row = {"contender": name, "first_s": firsts[name][0], "second_ms": firsts[name][1] * 1e3}
        row.update(summary(wall[name], cpu[name]))
        records.append(row)
        print(
            f"{name:18} {row['first_s']:10.2f} {row['second_ms']:8.1f} {row['min_ms']:8.2f} "
            f"{row['median_ms']:9.2f} {row['spread']:7.2f} {row['cpu_median_ms']:7.2f}"
        )
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
