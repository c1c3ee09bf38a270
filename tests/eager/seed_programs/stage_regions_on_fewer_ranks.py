"""A two-tower model whose towers are stage regions needing five stages (vision 2, text 2, and
the loss outside both) on a mesh of two pipeline ranks: placed on the ranks there are, the
pipelined loss and gradients equal one device's."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import spectrax as spx


def vision_tower(w, pixels):
    h = jnp.tanh(pixels @ w["v0"])
    h = spx.sxstage_iter(h)
    return jnp.tanh(h @ w["v1"])


def text_tower(w, tokens, image_features):
    h = jnp.tanh(tokens @ w["t0"]) + image_features
    h = spx.sxstage_iter(h)
    return h @ w["t1"]


def loss(w, pixels, tokens, y):
    image = spx.sxstage_region("vision", schedule=spx.GPipe(2))(vision_tower)(w, pixels)
    out = spx.sxstage_region("text", schedule=spx.GPipe(2))(text_tower)(w, tokens, image)
    return jnp.mean((out - y) ** 2)


def init(shape, k):
    n = int(np.prod(shape))
    return jnp.asarray(np.sin(np.arange(n) * 0.37 + k).reshape(shape) * 0.3, jnp.float32)


w = {"v0": init((6, 8), 0), "v1": init((8, 8), 1), "t0": init((5, 8), 2), "t1": init((8, 4), 3)}
pixels = init((4, 6), 4)
tokens = init((4, 5), 5)
y = init((4, 4), 6)
ref_loss, ref_grads = jax.value_and_grad(loss)(w, pixels, tokens, y)
mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
pipelined = spx.sxjit(loss, mesh=mesh, schedule=spx.GPipe(2), batch_argnums=(1, 2, 3))
with mesh:
    value, (grads,) = spx.sxvalue_and_grad(pipelined)(w, pixels, tokens, y)
print(
    json.dumps(
        {
            "loss": float(value),
            "ref_loss": float(ref_loss),
            "grads_close": {
                k: bool(np.allclose(np.asarray(grads[k]), ref_grads[k], rtol=1e-4, atol=1e-6)) for k in w
            },
        }
    )
)
