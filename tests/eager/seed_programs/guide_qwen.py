"""A Qwen style decoder block stack: biased q/k/v projections, per-head RMSNorm of queries and
keys, a SwiGLU MLP and a head tied to the embedding; greedy next tokens from the logits."""

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


class QwenBlock(spx.Module):
    def __init__(self, d, heads, rngs):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm1 = nn.RMSNorm(d)
        self.q_proj = nn.Linear(d, d, use_bias=True, rngs=rngs)
        self.k_proj = nn.Linear(d, d, use_bias=True, rngs=rngs)
        self.v_proj = nn.Linear(d, d, use_bias=True, rngs=rngs)
        self.o_proj = nn.Linear(d, d, use_bias=False, rngs=rngs)
        self.q_norm = nn.RMSNorm(self.hd)
        self.k_norm = nn.RMSNorm(self.hd)
        self.norm2 = nn.RMSNorm(d)
        self.gate_proj = nn.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.up_proj = nn.Linear(d, 2 * d, use_bias=False, rngs=rngs)
        self.down_proj = nn.Linear(2 * d, d, use_bias=False, rngs=rngs)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q_norm(self.q_proj(h).reshape(b, t, self.heads, self.hd))
        k = self.k_norm(self.k_proj(h).reshape(b, t, self.heads, self.hd))
        v = self.v_proj(h).reshape(b, t, self.heads, self.hd)
        x = x + self.o_proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down_proj(jax.nn.silu(self.gate_proj(h)) * self.up_proj(h))


class Qwen(spx.Module):
    def __init__(self, vocab, d, layers, rngs):
        super().__init__()
        self.embed_tokens = nn.Embed(vocab, d, rngs=rngs)
        self.layers = nn.ModuleList([QwenBlock(d, 2, rngs) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embed_tokens.attend(self.norm(x))


model = Qwen(vocab=17, d=8, layers=2, rngs=spx.Rngs(0))
fill(model)
tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
logits = spx.jit(lambda m, t: m(t))(model, tokens)
print(
    json.dumps(
        {
            "shape": list(logits.shape),
            "next": np.asarray(jnp.argmax(logits[:, -1], -1)).tolist(),
            "logit_sum": float(logits.sum()),
            "last": np.asarray(logits[:, -1, :4]).round(5).tolist(),
        }
    )
)
