"""One process of a two-process `spx.run` job with dropout (started by the launcher): writes its
losses, forward sums and stream counters to `OUT_DIR/process<i>.json`."""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import spectrax_eager as spx  # noqa: E402
import spectrax_mpmd as mp  # noqa: E402


class Net(spx.Module):
    def __init__(self):
        rngs = spx.Rngs(0, dropout=1)
        self.drop = spx.nn.Dropout(0.5, rngs=rngs)
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(8, 8, rngs=rngs) for _ in range(2)])

    def forward(self, x):
        for block in self.blocks:
            x = self.drop(jnp.tanh(block(x)))
        return x


def trace(mesh) -> dict:
    """Two training steps then two forward calls: losses, output sums (None where not held), counters."""
    model, record = Net(), {"losses": [], "sums": [], "counts": []}
    x, y = jax.random.normal(jax.random.key(1), (8, 8)), jax.random.normal(jax.random.key(2), (8, 8))
    mse = lambda o, t: jnp.mean((o - t) ** 2)  # noqa: E731
    for _ in range(2):
        loss, _ = spx.run(model, inputs=x, targets=y, mesh=mesh, loss_fn=mse, microbatches=2)
        record["losses"].append(float(loss))
        record["counts"].append(int(model.drop.rngs.dropout.count.value))
    for _ in range(2):
        out = spx.run(model, inputs=x, mesh=mesh, mode="forward", microbatches=2)
        record["sums"].append(float(jnp.sum(out)) if out.is_fully_addressable else None)
        record["counts"].append(int(model.drop.rngs.dropout.count.value))
    return record


if __name__ == "__main__":
    mp.initialize()  # join the launcher's job before touching devices
    record = trace(mp.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp"))
    with open(os.path.join(sys.argv[1], f"process{jax.process_index()}.json"), "w") as f:
        json.dump(record, f)
