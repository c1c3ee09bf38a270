"""`nn.MultiheadAttention` called every way the seed library's programs call it: a pre-norm block
writing `x = x + self.attn(h, h, h)`, cross-attention with one or two memory inputs, a boolean
`mask=` (True = may attend), `is_causal=True`, and PyTorch's `need_weights=False`: each call
returns the output alone."""

import json

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


class EncoderBlock(spx.Module):
    def __init__(self, d, heads, rngs):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, num_heads=heads, rngs=rngs)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.attn(h, h, h)
        return x


def summary(y):
    return [type(y).__name__, list(np.shape(y)), np.asarray(y).round(5).reshape(-1)[:4].tolist()]


block = EncoderBlock(8, 2, spx.Rngs(0))
fill(block)
attn = block.attn
x = jnp.asarray(np.sin(np.arange(2 * 5 * 8)).reshape(2, 5, 8), jnp.float32)
memory = jnp.asarray(np.cos(np.arange(2 * 3 * 8)).reshape(2, 3, 8), jnp.float32)
keep = jnp.asarray(np.tril(np.ones((5, 5), bool)))
out = {
    "block": summary(block(x)),
    "self_one_input": summary(attn(x)),
    "self_three_inputs": summary(attn(x, x, x)),
    "cross_two_inputs": summary(attn(x, memory)),
    "cross_three_inputs": summary(attn(x, memory, memory)),
    "mask": summary(attn(x, x, x, mask=keep)),
    "causal": summary(attn(x, is_causal=True)),
    "causal_three_inputs": summary(attn(x, x, x, is_causal=True)),
    "need_weights_false": summary(attn(x, x, x, need_weights=False)),
}
out["mask_is_causal"] = bool(jnp.allclose(attn(x, mask=keep), attn(x, is_causal=True), atol=1e-6))
print(json.dumps(out))
