"""Train a two-tower vision-language model with stage regions: each tower its own stages and schedule.

Image patches go through a 2-stage vision tower (region "vision", GPipe); tokens
through a 2-stage text tower (region "text", ZeroBubbleH1) whose second stage
adds the pooled vision features before its attention block and the language-model
head. The towers run side by side on 4 ranks (2 each): the text tower's first
stage does not wait for the images. The next token depends on a class that only
the image shows, so the loss falls below chance only through the vision tower.

The same model is also run as one linear chain of the same 4 stages (vision,
vision, text, text under one ZeroBubbleH1 schedule), for comparison: the script
prints the merged grid, the simulated bubble of both layouts with the stage costs
measured on this machine, and both step times. On CPU the fake devices share the
same cores, so the step times show overhead, not pipeline overlap.

Run: python examples/multimodal.py
"""

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spectrax_core as sc  # noqa: E402
import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.nn import MLP, Attention, Embed, LayerNorm, Linear  # noqa: E402
from spectrax_core.schedules import GPipe, ZeroBubbleH1, render_grid, simulate  # noqa: E402

VOCAB, CLASSES, PATCHES, PATCH_DIM = 32, 4, 8, 12


def init(key, d):
    k = iter(jax.random.split(key, 12))
    return {
        "patch": Linear.init(next(k), PATCH_DIM, d),
        "v_mlp0": MLP.init(next(k), d, 2 * d),
        "v_mlp1": MLP.init(next(k), d, 2 * d),
        "v_norm": LayerNorm.init(None, d),
        "embed": Embed.init(next(k), VOCAB, d),
        "t_attn0": Attention.init(next(k), d, 4),
        "t_mlp0": MLP.init(next(k), d, 2 * d),
        "fuse": Linear.init(next(k), d, d),
        "t_attn1": Attention.init(next(k), d, 4),
        "t_mlp1": MLP.init(next(k), d, 2 * d),
        "norm": LayerNorm.init(None, d),
        "head": Linear.init(next(k), d, VOCAB),
    }


def model(vision_schedule=None, text_schedule=None, regions=True):
    """The training loss; `regions=False` gives the same computation as one linear chain."""

    def region(name, schedule):
        return mp.sxstage_region(name, schedule=schedule) if regions else contextlib.nullcontext()

    def loss_fn(p, patches, tokens):
        with region("vision", vision_schedule):
            v = sc.apply(p["patch"], patches)
            v = v + sc.apply(p["v_mlp0"], v)  # V0
            v = mp.sxstage_iter(v)
            v = v + sc.apply(p["v_mlp1"], v)  # V1
            features = sc.apply(p["v_norm"], v).mean(axis=1)
        if not regions:
            features = mp.sxstage_iter(features)  # the chain: the text tower runs after the vision tower
        with region("text", text_schedule):
            h = sc.apply(p["embed"], tokens[:, :-1])
            h = h + sc.apply(p["t_attn0"], h)  # T0
            h = h + sc.apply(p["t_mlp0"], h)
            h = mp.sxstage_iter(h)
            h = h + sc.apply(p["fuse"], features)[:, None, :]  # T1 reads the vision features
            h = h + sc.apply(p["t_attn1"], h)
            h = h + sc.apply(p["t_mlp1"], h)
            logits = sc.apply(p["head"], sc.apply(p["norm"], h))
            return sc.losses.softmax_cross_entropy(logits, tokens[:, 1:])

    return loss_fn


def make_batch(key, batch, seq):
    """Each image shows a class c (a noisy one-hot pattern); its caption counts up in steps of c + 1."""
    kc, kn, ks = jax.random.split(key, 3)
    c = jax.random.randint(kc, (batch,), 0, CLASSES)
    pattern = jax.nn.one_hot(c, PATCH_DIM)[:, None, :] * 2.0
    patches = pattern + 0.5 * jax.random.normal(kn, (batch, PATCHES, PATCH_DIM))
    start = jax.random.randint(ks, (batch, 1), 0, VOCAB)
    tokens = (start + (c[:, None] + 1) * jnp.arange(seq)[None, :]) % VOCAB
    return patches, tokens


def step_time(step, params, batch, rounds):
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(step(params, *batch))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="training steps")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    m = args.microbatches
    mesh = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")  # 4 ranks x 2 devices
    params = init(jax.random.key(0), args.d_model)
    batch = make_batch(jax.random.key(1), args.batch, args.seq)

    towers = model(GPipe(microbatches=m), ZeroBubbleH1(microbatches=m))
    step = mp.sxvalue_and_grad(towers, mesh=mesh, schedule=ZeroBubbleH1(microbatches=m))
    chain = mp.sxvalue_and_grad(model(regions=False), mesh=mesh, schedule=ZeroBubbleH1(microbatches=m))

    loss, grads = step(params, *batch)
    ref_loss, ref_grads = jax.value_and_grad(towers)(params, *batch)
    equal = all(
        np.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
    )
    print(f"pipelined loss {float(loss):.6f}  unsplit loss {float(ref_loss):.6f}  grads equal: {equal}")

    plan = step.plan_for(params, *batch)
    merged = plan.schedule
    labels = merged.stage_labels(4)
    print("stages per rank:", [[labels[s] for s in merged.stages_of(r, 4)] for r in range(4)])
    measured = simulate(merged, 4, step.profile_stages(params, *batch).stage_cost())
    as_chain = simulate(ZeroBubbleH1(microbatches=m), 4, chain.profile_stages(params, *batch).stage_cost())
    print("\nmerged schedule (unit costs):")
    print(render_grid(simulate(merged, 4)))
    print("\nsimulated with the stage costs measured here:")
    print(f"  {'layout':<34} {'bubble':>7} {'makespan':>12}")
    print(
        f"  {'two regions (GPipe | ZeroBubbleH1)':<34} {measured.bubble_fraction:>7.3f} {measured.makespan * 1e3:>9.2f} ms"
    )
    print(
        f"  {'one linear chain (ZeroBubbleH1)':<34} {as_chain.bubble_fraction:>7.3f} {as_chain.makespan * 1e3:>9.2f} ms"
    )
    print("\nmeasured step time here (median of 5; CPU devices share the cores):")
    print(
        f"  two regions {step_time(step, params, batch, 5) * 1e3:.1f} ms   one chain {step_time(chain, params, batch, 5) * 1e3:.1f} ms"
    )

    opt = mp.StagedOptimizer(optax.adamw(args.lr), max_grad_norm=1.0)
    state = opt.init(params, grads)
    print(f"\ntraining (chance level: {np.log(VOCAB):.3f})")
    for it in range(args.steps):
        batch = make_batch(jax.random.key(100 + it), args.batch, args.seq)
        loss, grads = step(params, *batch)
        params, state = opt.update(grads, state, params)
        if it % 10 == 0 or it == args.steps - 1:
            print(f"step {it:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
