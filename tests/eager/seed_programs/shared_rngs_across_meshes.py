"""One `Rngs` shared by three models, each built inside `with logical_axis_rules(RULES), mesh:` of
its own mesh (fsdp over eight devices; dp=2 x fsdp=4; two pipeline ranks x four fsdp devices)
and trained with spx.run there: every loss equals the single-device loss."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn
from spectrax.sharding import logical_axis_rules

RULES = [("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("mlp", "tp"), ("vocab", "tp")]


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


class Block(spx.Module):
    def __init__(self, d, rngs):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * d, sharding=("embed", "mlp"), rngs=rngs)
        self.down = nn.Linear(2 * d, d, sharding=("mlp", "embed"), rngs=rngs)

    def forward(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class LM(spx.Module):
    def __init__(self, vocab, d, layers, rngs):
        super().__init__()
        self.embed = nn.Embed(vocab, d, sharding=("vocab", "embed"), rngs=rngs)
        self.blocks = nn.ModuleList([Block(d, rngs) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.head = nn.Linear(d, vocab, use_bias=False, sharding=("embed", "vocab"), rngs=rngs)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def cross_entropy(logits, labels):
    return -(jax.nn.log_softmax(logits, axis=-1) * jax.nn.one_hot(labels, logits.shape[-1])).sum(-1).mean()


rngs = spx.Rngs(0)
ids = jnp.asarray(np.arange(8 * 6).reshape(8, 6) * 7 % 32)
labels = jnp.asarray(np.arange(8 * 6).reshape(8, 6) * 5 % 32)
reference = LM(32, 8, 4, spx.Rngs(1))
fill(reference)
ref_loss = spx.value_and_grad(lambda m: cross_entropy(m(ids), labels))(reference)[0]
meshes = {
    "fsdp": (spx.create_mesh(axis_dims=(1, 1, -1, 1, 1, 1)), 1),
    "dp_fsdp": (spx.create_mesh(axis_dims=(1, 2, -1, 1, 1, 1)), 1),
    "mpmd": (spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp"), 4),
}
losses = {}
for name, (mesh, microbatches) in meshes.items():
    with logical_axis_rules(RULES), mesh:
        model = LM(32, 8, 4, rngs)
        fill(model)
        loss, _ = spx.run(
            model,
            inputs=ids,
            targets=labels,
            mesh=mesh,
            mode="train",
            loss_fn=cross_entropy,
            microbatches=microbatches,
        )
        jax.block_until_ready(loss)
    losses[name] = float(loss)
print(json.dumps({"losses": losses, "ref_loss": float(ref_loss)}))
