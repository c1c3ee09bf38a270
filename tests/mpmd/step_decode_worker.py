"""One process of a two-process `StepDecoder` job (started by the launcher): a user's decode step
(`decode_model`) on 4 ranks, 2 per process, generates ragged prompts (greedy; seeded sampling with
stop tokens and budgets) and writes to `OUT_DIR/process<i>.json` its tokens and each prompt's
tokens decoded alone and unsplit."""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import decode_model as M  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.models import Sampler  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11], [12, 13], [14, 15, 16], [2], [4, 4, 4, 4]]


def run(mesh) -> dict:
    params = M.init_params(jax.random.key(0))
    decoder = mp.StepDecoder(M.decode_step(4), params, M.init_cache, mesh=mesh)
    keys = jax.random.split(jax.random.key(3), len(PROMPTS))
    seeded = dict(sampler=Sampler(0.9, top_k=6), stop_tokens=[2])
    budgets = [5, 2, 1, 5, 3, 5, 1, 1]
    out = {"tokens": [], "reference": []}
    for options, budget in ((dict(), 5), (dict(seeded, keys=keys), budgets)):
        out["tokens"].append(np.asarray(decoder.generate(PROMPTS, budget, groups=4, **options)).tolist())
        per = np.broadcast_to(budget, (len(PROMPTS),))
        alone = []
        for b, (p, n) in enumerate(zip(PROMPTS, per)):
            kw = dict(options, key=keys[b]) if options else {}
            kw.pop("keys", None)
            alone.append(M.alone(params, p, int(n), **kw) + [0] * (5 - int(n)))
        out["reference"].append(alone)
    return out


if __name__ == "__main__":
    mp.initialize()  # join the launcher's job before touching devices
    record = run(mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp"))
    with open(os.path.join(sys.argv[1], f"process{jax.process_index()}.json"), "w") as f:
        json.dump(record, f)
