"""A GPT-2 style model: token and position embeddings, pre-norm blocks of causal self-attention
and an MLP, a head tied to the token embedding; one jitted loss and its gradient."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax import nn


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


class Block(spx.Module):
    def __init__(self, d, heads, rngs):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.CausalSelfAttention(d, heads, rngs=rngs)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.MLPBlock(d, 4 * d, rngs=rngs)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(spx.Module):
    def __init__(self, vocab, d, heads, layers, length, rngs):
        super().__init__()
        self.wte = nn.Embed(vocab, d, rngs=rngs)
        self.wpe = spx.Parameter(jnp.zeros((length, d)))
        self.blocks = nn.ModuleList([Block(d, heads, rngs) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe.value[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.value.T


model = GPT2(vocab=11, d=8, heads=2, layers=2, length=6, rngs=spx.Rngs(0))
fill(model)
tokens = jnp.asarray([[1, 4, 2, 9, 3, 0], [5, 5, 7, 1, 10, 2]])


def loss_fn(m, tokens):
    logits = m(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


loss, grads = spx.jit(spx.value_and_grad(loss_fn))(model, tokens)
norms = sorted(float(jnp.linalg.norm(g)) for _, _, g in grads.items())
print(
    json.dumps(
        {
            "logits_shape": list(model(tokens).shape),
            "loss": float(loss),
            "n_grads": len(norms),
            "grad_norm_max": norms[-1],
            "grad_norm_sum": sum(norms),
            "params": int(spx.inspect.count_parameters(model)),
        }
    )
)
