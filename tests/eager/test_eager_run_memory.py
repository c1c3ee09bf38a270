"""`spx.run` and `mp.run` / `mp.runner` with per-stage recompute and offload: the same loss and gradients
as `jax.value_and_grad` of the unsplit model on one device, offloaded values in host memory, and the
memory settings in the compiled-run cache key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_core import apply
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM
from spectrax_eager._pipeline import run as eager_run

VOCAB, D, LEN, BATCH = 16, 16, 4, 8
RTOL, ATOL = 1e-5, 1e-6
MEMORY = [  # (remat, offload) for four stages
    ({1: "dots_saveable", 2: True}, True),
    (["nothing_saveable", False, "dots_with_no_batch_dims_saveable", False], [0.5, "residuals", True, False]),
]


def close(actual, expected):
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL)


def mesh4():
    return spx.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")


class Net(spx.Module):
    def __init__(self, rngs):
        self.embed = spx.nn.Embed(VOCAB, D, rngs=rngs)
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(D, D, rngs=rngs) for _ in range(4)])
        self.head = spx.nn.Linear(D, VOCAB, rngs=rngs)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + jnp.tanh(block(h))
        return self.head(h)


def batch():
    k1, k2 = jax.random.split(jax.random.key(1))
    return jax.random.randint(k1, (BATCH, LEN), 0, VOCAB), jax.random.randint(k2, (BATCH, LEN), 0, VOCAB)


@pytest.mark.parametrize("remat,offload", MEMORY)
def test_spx_run_with_recompute_and_offload_matches_value_and_grad(remat, offload):
    model, (tokens, targets) = Net(spx.Rngs(0)), batch()
    loss_fn = softmax_cross_entropy
    ref_loss, ref_grads = jax.jit(spx.value_and_grad(lambda m: loss_fn(m(tokens), targets)))(model)
    before = set(eager_run._runners)
    kwargs = dict(
        inputs=tokens, targets=targets, mesh=mesh4(), loss_fn=loss_fn, schedule=spx.Std1F1B(microbatches=4)
    )
    loss, grads = spx.run(model, remat=remat, offload=offload, **kwargs)
    close(loss, ref_loss)
    close(grads, ref_grads)
    (key,) = set(eager_run._runners) - before
    assert key.memory  # the settings are in the cache key: a plain run compiles its own programs
    spx.run(model, **kwargs)
    plain = (("offload", False), ("remat", False))
    assert key.memory != plain and any(k.memory == plain and k[:-1] == key[:-1] for k in eager_run._runners)


@pytest.mark.parametrize("remat,offload", MEMORY)
def test_mp_runner_with_recompute_and_offload_matches_value_and_grad(remat, offload):
    lm = TransformerLM.init(
        jax.random.key(0), vocab_size=VOCAB, d_model=D, n_layers=4, n_heads=2, n_kv_heads=1, d_ff=32
    )
    tokens, targets = batch()
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda m: softmax_cross_entropy(apply(m, tokens), targets))
    )(lm)
    step = mp.runner(
        mesh=mesh4(),
        loss_fn=softmax_cross_entropy,
        schedule=spx.ZeroBubbleH1(microbatches=4),
        remat=remat,
        offload=offload,
    )
    loss, grads = step(lm, tokens, targets)
    close(loss, ref_loss)
    close(grads, ref_grads)
    plan = step.runner.step.plan_for(lm, None, tokens, targets)
    assert any(type(k).__name__ == "Offloaded" for k in plan.slot_names.values())
