"""A Llama 3 style decoder: RMSNorm, rotary positions, grouped-query attention (2 KV heads for 4
query heads), a SwiGLU MLP; a few jitted training steps with an optimizer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import spectrax as spx
from spectrax import nn
from spectrax.contrib import Optimizer


def fill(model):
    """Every float parameter set from its shape alone (the same numbers on any library)."""
    for _, var in spx.iter_variables(model):
        if var.kind in ("parameters", "lora") and jnp.issubdtype(var.value.dtype, jnp.floating):
            n = int(np.prod(var.value.shape))
            var.value = jnp.asarray(np.sin(np.arange(n) * 0.37 + n * 0.01).reshape(var.value.shape) * 0.3)


def rope(x, base=10000.0):
    t, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / base ** (jnp.arange(0, d, 2) / d)
    ang = jnp.arange(t)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


class Attention(spx.Module):
    def __init__(self, d, heads, kv_heads, rngs):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.q = nn.Linear(d, heads * self.hd, use_bias=False, rngs=rngs)
        self.k = nn.Linear(d, kv_heads * self.hd, use_bias=False, rngs=rngs)
        self.v = nn.Linear(d, kv_heads * self.hd, use_bias=False, rngs=rngs)
        self.o = nn.Linear(heads * self.hd, d, use_bias=False, rngs=rngs)

    def forward(self, x):
        b, t, _ = x.shape
        q = rope(self.q(x).reshape(b, t, self.heads, self.hd))
        k = rope(self.k(x).reshape(b, t, self.kv_heads, self.hd))
        v = self.v(x).reshape(b, t, self.kv_heads, self.hd)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.reshape(b, t, -1))


class Block(spx.Module):
    def __init__(self, d, heads, kv_heads, hidden, rngs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads, rngs)
        self.mlp_norm = nn.RMSNorm(d)
        self.gate = nn.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.up = nn.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.down = nn.Linear(hidden, d, use_bias=False, rngs=rngs)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(spx.Module):
    def __init__(self, vocab, d, layers, rngs):
        super().__init__()
        self.embed = nn.Embed(vocab, d, rngs=rngs)
        self.layers = nn.ModuleList([Block(d, 4, 2, 3 * d, rngs) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, use_bias=False, rngs=rngs)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


model = Llama(vocab=13, d=16, layers=2, rngs=spx.Rngs(0))
fill(model)
tokens = jnp.asarray([[1, 5, 2, 7, 3, 12, 4, 0], [9, 9, 1, 2, 3, 4, 5, 6]])


def loss_fn(m, tokens):
    logp = jax.nn.log_softmax(m(tokens[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


opt = Optimizer.create(model, optax.adam(1e-2), wrt="parameters")


@spx.jit(mutable="parameters")
def train_step(m, opt, tokens):
    loss, grads = spx.value_and_grad(loss_fn)(m, tokens)
    params, opt = opt.update(spx.tree_state(m).filter("parameters"), grads)
    spx.update(m, params)
    return loss, opt


losses = []
for _ in range(3):
    loss, opt = train_step(model, opt, tokens)
    losses.append(float(loss))
print(
    json.dumps({"losses": losses, "params": int(spx.inspect.count_parameters(model)), "step": int(opt.step)})
)
