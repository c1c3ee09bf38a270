"""The one-device reference of a pipelined training step: one jitted `lax.scan` accumulating
`value_and_grad` over the same microbatches."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def scan_step(grad: Callable, m: int) -> Callable:
    """`jax.jit` of `(params, batch) -> (loss, grads)`: `grad` (a `jax.value_and_grad`) of each
    of the `m` microbatches the batch's leading axis splits into, summed over a `lax.scan`, each
    divided by m (the mean a pipelined step computes)."""

    def scan(params, batch):
        xs, ys = (a.reshape(m, -1, a.shape[-1]) for a in batch)

        def body(carry, mb):
            loss, g = carry
            value, gi = grad(params, mb)
            return (loss + value / m, jax.tree.map(lambda a, b: a + b / m, g, gi)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, zero, (xs, ys))[0]

    return jax.jit(scan)
