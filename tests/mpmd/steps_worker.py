"""A 2-process job that lists a checkpoint directory's steps while the other process deletes one:
both save steps 1 and 2; process 1 waits 2 s before listing, so process 0 (which deletes the
files) gets to `delete` first. Each process writes the later steps it saw and the steps left.

    steps_worker.py CKPT OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import spectrax_mpmd as mp  # noqa: E402

mp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    ckpt, out = sys.argv[1:3]
    with mp.CheckpointManager(ckpt, async_save=False) as manager:
        for step in (1, 2):
            manager.save(step, params={"w": np.full(3, step, np.float32)})
        if jax.process_index() == 1:
            time.sleep(2)
        later = [k for k in manager.all_steps() if k > 1]
        for k in later:
            manager.delete(k)
        left = manager.all_steps()
    with open(os.path.join(out, f"p{jax.process_index()}.json"), "w") as f:
        json.dump({"later": later, "left": left}, f)


if __name__ == "__main__":
    main()
