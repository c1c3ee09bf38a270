"""Train a 4-stage heterogeneous pipeline with true MPMD: one program per rank.

Stages differ in class and shapes: int tokens -> embedding (stage 0) -> a
wide MLP block (stage 1) -> a narrow block (stage 2) -> classifier head and
loss (stage 3). Each stage runs on its own 2-device submesh of 8 (fake CPU)
devices; the schedule is 1F1B over 8 microbatches. The parameters are made
on the ranks that hold them (`mp.init_on_owners`), never whole on one device;
the loss and gradients are checked once against the unsplit `jax.value_and_grad` on one device.

Run: python examples/pipeline_train.py
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spectrax_core as sc  # noqa: E402
import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.nn import MLP, Embed, LayerNorm, Linear  # noqa: E402
from spectrax_core.schedules import Std1F1B  # noqa: E402

VOCAB, SEQ, CLASSES, BATCH = 64, 12, 5, 64


def init(key):
    k = jax.random.split(key, 5)
    return {
        "embed": Embed.init(k[0], VOCAB, 32),
        "wide": MLP.init(k[1], 32, 128),
        "proj": Linear.init(k[2], 32, 16),
        "norm": LayerNorm.init(k[4], 16),
        "head": Linear.init(k[3], 16, CLASSES),
    }


def loss_fn(params, batch):
    tokens, labels = batch
    x = sc.apply(params["embed"], tokens).mean(axis=1)  # stage 0: (b, 32)
    x = mp.sxstage_iter(x)
    x = x + sc.apply(params["wide"], x)  # stage 1: residual MLP, 32 -> 128 -> 32
    x = mp.sxstage_iter(x)
    x = jnp.tanh(sc.apply(params["proj"], x))  # stage 2: 32 -> 16
    x = mp.sxstage_iter(x)
    logits = sc.apply(params["head"], sc.apply(params["norm"], x))  # stage 3: 16 -> 5
    return sc.losses.softmax_cross_entropy(logits, labels)


def make_batch(key):
    tokens = jax.random.randint(key, (BATCH, SEQ), 0, VOCAB)
    small = (tokens < VOCAB // 2).sum(axis=1)  # how many tokens are in the lower half
    labels = jnp.clip((small - SEQ // 2) // 2 + CLASSES // 2, 0, CLASSES - 1)
    return tokens, labels


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps after the exactness check")
    steps = parser.parse_args(argv).steps
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")  # 4 ranks x 2 devices
    step = mp.sxvalue_and_grad(loss_fn, mesh=mesh, schedule=Std1F1B(microbatches=8))
    opt = mp.StagedOptimizer(optax.adamw(1e-2), max_grad_norm=1.0)

    batch = make_batch(jax.random.key(1))
    params = mp.init_on_owners(step, init, jax.random.key(0), batch)  # each leaf made on its rank
    loss, grads = step(params, batch)
    whole = init(jax.random.key(0))  # the same values, whole on one device: the unsplit reference
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(whole, batch)
    close = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    )
    print(f"pipelined loss {float(loss):.6f}  unsplit loss {float(ref_loss):.6f}  grads equal: {close}")
    print("stages per rank:", [sorted({s for s, r in enumerate(step.plan_for(params, batch).stage_ranks) if r == rank}) for rank in range(4)])

    state = opt.init(params, grads)
    for it in range(steps):
        batch = make_batch(jax.random.key(100 + it))
        loss, grads = step(params, batch)
        params, state = opt.update(grads, state, params)
        if it % 10 == 0 or it == steps - 1:
            print(f"step {it:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
