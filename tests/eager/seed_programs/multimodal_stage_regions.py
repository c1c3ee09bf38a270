"""A two-tower model whose towers are stage regions: a vision tower and a text tower, each split
in two stages and scheduled on its own (the loss is the text tower's last step); the pipelined
loss and gradients equal one device's; the regions read back from the traced jaxpr."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx
from spectrax.runtime.mpmd.markers import stage_region_specs


def vision_tower(w, pixels):
    h = jnp.tanh(pixels @ w["v0"])
    h = spx.sxstage_iter(h)
    return jnp.tanh(h @ w["v1"])


def text_tower(w, tokens, image_features, y):
    h = jnp.tanh(tokens @ w["t0"]) + image_features
    h = spx.sxstage_iter(h)
    return jnp.mean((h @ w["t1"] - y) ** 2)


def loss(w, pixels, tokens, y):
    image = spx.sxstage_region("vision", schedule=spx.GPipe(2))(vision_tower)(w, pixels)
    return spx.sxstage_region("text", schedule=spx.GPipe(2))(text_tower)(w, tokens, image, y)


def init(shape, k):
    n = int(np.prod(shape))
    return jnp.asarray(np.sin(np.arange(n) * 0.37 + k).reshape(shape) * 0.3, jnp.float32)


w = {"v0": init((6, 8), 0), "v1": init((8, 8), 1), "t0": init((5, 8), 2), "t1": init((8, 4), 3)}
pixels = init((4, 6), 4)
tokens = init((4, 5), 5)
y = init((4, 4), 6)
ref_loss, ref_grads = jax.value_and_grad(loss)(w, pixels, tokens, y)
mesh = spx.create_mesh(axis_dims=(4, 1, -1, 1, 1, 1), mpmd_axis="pp")
pipelined = spx.sxjit(loss, mesh=mesh, schedule=spx.GPipe(2), batch_argnums=(1, 2, 3))
with mesh:
    value, (grads,) = spx.sxvalue_and_grad(pipelined)(w, pixels, tokens, y)
regions = stage_region_specs(jax.make_jaxpr(loss)(w, pixels, tokens, y).jaxpr)
print(
    json.dumps(
        {
            "loss": float(value),
            "ref_loss": float(ref_loss),
            "regions": sorted({spec.name for spec in regions}),
            "grads_close": {
                k: bool(np.allclose(np.asarray(grads[k]), ref_grads[k], rtol=1e-4, atol=1e-6)) for k in w
            },
        }
    )
)
