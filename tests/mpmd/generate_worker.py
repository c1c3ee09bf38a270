"""One process of a two-process generation job (started by the launcher): trains two steps of a
small LM on 4 ranks (2 per process), generates through the runner after each (greedy, then seeded
sampling with stop tokens and budgets, 4 groups), and writes to `OUT_DIR/process<i>.json` its
tokens, the unsplit reference's (`spectrax_core.models.generate` on the gathered parameters, one
device) and the backend compiles of the second generation."""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import Sampler, TransformerLM, generate  # noqa: E402

BATCH, STEPS = 8, 5


def options() -> tuple[dict, ...]:
    """Greedy; seeded sampling with a stop token and budgets (the last group stops after one round)."""
    seeded = dict(sampler=Sampler(0.9, top_k=6), keys=jax.random.split(jax.random.key(3), BATCH))
    return (
        dict(max_new_tokens=STEPS),
        dict(max_new_tokens=[STEPS, 2, 1, STEPS, 3, STEPS, 1, 1], stop_tokens=[2], pad_id=15, **seeded),
    )


def run(mesh) -> dict:
    lm = TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    tx = optax.sgd(0.5)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=S.GPipe(microbatches=2), tx=tx)
    params = mp.stage_blocks(lm, 4)
    state, data = tx.init(params), jax.random.randint(jax.random.key(2), (BATCH, 7), 0, 16)
    prompt = jax.random.randint(jax.random.key(1), (BATCH, 4), 0, 16)
    record = {"tokens": [], "reference": [], "compiles": None}
    compiles = []

    def count(event, duration, **_):
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None

    for k in range(2):
        _, params, state = step.update(params, state, data[:, :-1], data[:, 1:])
        unsplit = mp.unstage_blocks(mp.gather(params))
        if k == 1:
            jax.monitoring.register_event_duration_secs_listener(count)
        for kw in options():
            budget = kw.pop("max_new_tokens")
            record["tokens"].append(
                jnp.asarray(step.generate(params, prompt, budget, groups=4, **kw)).tolist()
            )
            if k == 1:
                record["compiles"] = len(compiles)  # before the reference's own compiles
            record["reference"].append(generate(unsplit, prompt, budget, **kw).tolist())
        if k == 1:
            jax.monitoring.unregister_event_duration_listener(count)
    return record


if __name__ == "__main__":
    mp.initialize()  # join the launcher's job before touching devices
    record = run(mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp"))
    with open(os.path.join(sys.argv[1], f"process{jax.process_index()}.json"), "w") as f:
        json.dump(record, f)
