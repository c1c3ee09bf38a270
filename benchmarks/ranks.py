"""Pipeline ranks of different sizes: the main job's LM on an even split against a heavier last rank.

The LM of examples/train_lm.py (byte vocabulary, d_model 128, 4 blocks of 4 heads and an MLP of
512, untied head), one block per stage, the last stage also carrying the final norm, the head
and the loss; the one-plan training step (`sxvalue_and_grad_and_apply`, clipped AdamW, Std1F1B
over 8 microbatches of 4 sequences of 64 tokens), parameters sharded by the default rules on
each rank's own submesh, activations split over the receiver's `fsdp` axis. Contenders: every
rank on 2 devices, and ranks of 1, 1, 2 and 4 devices (the last the heaviest). Per contender:
the step's wall time over interleaved rounds (min, median, spread, issuing-thread CPU), the
measured peak bytes per rank (the largest per-device share alive between actions), and the
loss of both, which agree.

    python benchmarks/ranks.py [--rounds 5] [--json benchmarks/results/ranks.json]
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
import optax  # noqa: E402
from _timing import interleaved, summary  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import apply  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core import sharding as core_sharding  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

SPLITS = {"even": [{"fsdp": 2}] * 4, "heavy_last": [{"fsdp": n} for n in (1, 1, 2, 4)]}
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
BATCH, LENGTH, MICROBATCHES = 32, 64, 8


def model():
    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512, tie_embeddings=False
    )
    return {
        "embed": lm.embed,
        "blocks": [lm.blocks.layer(k) for k in range(4)],
        "norm": lm.norm,
        "head": lm.head,
    }


def loss(params, tokens, targets):
    x = apply(params["embed"], tokens)
    for k, block in enumerate(params["blocks"]):
        x = apply(block, x)
        if k < 3:
            x = mp.sxstage_iter(x, sharding=P("fsdp"))
    return softmax_cross_entropy(apply(params["head"], apply(params["norm"], x)), targets)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/ranks.json")
    args = parser.parse_args(argv)
    seq = jax.random.randint(jax.random.key(1), (BATCH, LENGTH + 1), 0, 256)
    batch = (seq[:, :-1], seq[:, 1:])
    params = model()
    steps, states, rows = {}, {}, {}
    for name, ranks in SPLITS.items():
        mesh = mp.create_rank_mesh(ranks)
        steps[name] = mp.sxvalue_and_grad_and_apply(
            loss, TX, mesh=mesh, schedule=S.Std1F1B(MICROBATCHES),
            rules=core_sharding.Rules.default(),
        )  # fmt: skip
        state = (jax.tree.map(jnp.copy, params), TX.init(params))
        value, *state = steps[name](*state, *batch)
        states[name] = state
        peaks = steps[name].measure_peak_bytes(*state, *batch)
        rows[name] = {"name": name, "rank_sizes": list(mesh.rank_sizes), "first_loss": float(value),
                      "peak_mib_per_rank": [p / 2**20 for p in peaks]}  # fmt: skip

    def stepper(name):
        def call():
            value, *states[name] = steps[name](*states[name], *batch)
            return value

        return call

    wall, cpu = interleaved({name: stepper(name) for name in SPLITS}, args.rounds, calls=3, warmup=1)
    for name in SPLITS:
        row = rows[name] = rows[name] | summary(wall[name], cpu[name])
        peaks = ", ".join(f"{p:.2f}" for p in row["peak_mib_per_rank"])
        print(
            f"{name:10} {str(row['rank_sizes']):14} median {row['median_ms']:.1f} ms  "
            f"min {row['min_ms']:.1f} ms  spread {row['spread']:.2f}  cpu {row['cpu_median_ms']:.1f} ms  "
            f"peak MiB per rank [{peaks}]  first loss {row['first_loss']:.6f}"
        )
    out = {"devices": jax.devices()[0].platform, "splits": list(rows.values())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
