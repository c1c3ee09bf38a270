"""A ViT: patches by a strided convolution, a class token, pre-norm encoder blocks whose attention
is called as `x + attn(x)`, a classification head; the logits and a cross-entropy loss."""

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


class EncoderBlock(spx.Module):
    def __init__(self, d, heads, rngs):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, rngs=rngs)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.MLPBlock(d, 2 * d, rngs=rngs)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(spx.Module):
    def __init__(self, patch, channels, d, heads, layers, classes, rngs):
        super().__init__()
        self.patch = nn.Conv2d(channels, d, kernel_size=patch, stride=patch, padding="VALID", rngs=rngs)
        self.cls = spx.Parameter(jnp.zeros((1, 1, d)))
        self.blocks = nn.ModuleList([EncoderBlock(d, heads, rngs) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes, rngs=rngs)

    def forward(self, images):
        x = self.patch(images)
        b = x.shape[0]
        x = x.reshape(b, -1, x.shape[-1])
        x = jnp.concatenate([jnp.broadcast_to(self.cls.value, (b, 1, x.shape[-1])), x], axis=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


model = ViT(patch=2, channels=3, d=8, heads=2, layers=2, classes=5, rngs=spx.Rngs(0))
fill(model)
images = jnp.asarray(np.cos(np.arange(2 * 4 * 4 * 3)).reshape(2, 4, 4, 3), jnp.float32)
labels = jnp.asarray([1, 3])
logits = spx.jit(lambda m, x: m(x))(model, images)
loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1))
print(
    json.dumps(
        {
            "logits": np.asarray(logits).round(5).tolist(),
            "loss": float(loss),
            "kernel_shape": list(model.patch.weight.value.shape),
        }
    )
)
