"""Pipeline ranks of different sizes through the model-level entry points: `run`/`runner` (train
and forward, parameters sharded by the rules on each rank's own submesh) and generation
(`PipelineDecoder`, `StepDecoder`), each against the unsplit model on one device."""

from __future__ import annotations

import functools

import decode_model as M
import jax
import numpy as np
import pytest
from mpmd_cases import assert_close, lm_batch, tiny_lm
from test_mpmd_decode_step import PROMPTS, alone, params
from test_mpmd_regions import M as REGION_MICROBATCHES
from test_mpmd_regions import batch, tower_params, towers_loss

import spectrax_mpmd as mp
from spectrax_core import apply
from spectrax_core import schedules as S
from spectrax_core import sharding as core_sharding
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import greedy_decode

UNEVEN = [{"fsdp": 1}, {"fsdp": 1}, {"fsdp": 2}, {"fsdp": 2, "tp": 2}]


@functools.cache
def mesh():
    return mp.create_rank_mesh(UNEVEN)


@functools.cache
def lm_and_batch():
    lm = tiny_lm(jax.random.key(0), n_layers=4, tie_embeddings=False)
    return (lm, *lm_batch(jax.random.key(1), 8))


@pytest.mark.slow
def test_runner_trains_with_rules_like_the_unsplit_model():
    lm, tokens, targets = lm_and_batch()
    rules = core_sharding.Rules.default()
    step = mp.runner(mesh=mesh(), loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(4), rules=rules)
    loss, grads = step(lm, tokens, targets)
    want = jax.jit(jax.value_and_grad(lambda m: softmax_cross_entropy(apply(m, tokens), targets)))(lm)
    assert_close((loss, grads), want)
    head = mesh().submesh(3)
    assert grads.head.weight.sharding.device_set == set(head.devices.flat)
    assert grads.head.weight.sharding.shard_shape(grads.head.weight.shape) != grads.head.weight.shape


@pytest.mark.slow
def test_runner_balances_the_blocks_on_the_ranks_own_sizes_and_trains_exactly():
    """`stage_sizes="auto"` profiles each block on a rank of each size the mesh has and cuts there."""
    lm, tokens, targets = lm_and_batch()
    step = mp.runner(
        mesh=mesh(), loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(4),
        rules=core_sharding.Rules.default(), stage_sizes="auto",
    )  # fmt: skip
    loss, grads = step(lm, tokens, targets)
    want = jax.jit(jax.value_and_grad(lambda m: softmax_cross_entropy(apply(m, tokens), targets)))(lm)
    assert_close((loss, grads), want)
    assert isinstance(step.balance, mp.DeviceBalance) and sum(step.balance.sizes) == 4


def test_run_forward_gives_the_unsplit_logits():
    lm, tokens, _ = lm_and_batch()
    out = mp.run(lm, inputs=tokens, mesh=mesh(), mode="forward", microbatches=4)
    assert_close(out, jax.jit(apply)(lm, tokens))


@pytest.mark.parametrize("groups", [2, 4])
def test_pipeline_decoder_gives_the_unsplit_tokens(groups):
    lm, tokens, _ = lm_and_batch()
    prompt = tokens[:4]
    got = mp.PipelineDecoder(lm, mesh=mesh()).generate(prompt, 4, groups=groups)
    np.testing.assert_array_equal(got, greedy_decode(lm, prompt, 4))


def test_step_decoder_gives_the_unsplit_tokens():
    dec = mp.StepDecoder(M.decode_step(4), params(), M.init_cache, mesh=mesh())
    np.testing.assert_array_equal(np.asarray(dec.generate(PROMPTS, 4, groups=2)), alone(4))


def test_the_eager_facades_run_trains_on_uneven_ranks_like_one_device():
    import jax.numpy as jnp

    import spectrax_eager as spx

    class Net(spx.Module):
        def __init__(self, rngs):
            self.embed = spx.nn.Linear(8, 32, rngs=rngs)
            self.blocks = spx.nn.ModuleList([spx.nn.Linear(32, 32, rngs=rngs) for _ in range(4)])
            self.head = spx.nn.Linear(32, 4, rngs=rngs)

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = h + jnp.tanh(block(h))
            return self.head(h)

    model = Net(spx.Rngs(0))
    x, y = jax.random.normal(jax.random.key(0), (32, 8)), jax.random.normal(jax.random.key(1), (32, 4))
    mse = lambda out, target: jnp.mean((out - target) ** 2)  # noqa: E731
    one = spx.create_mesh((1, 1, 1, 1, 1, 1), devices=jax.devices()[:1])
    want = spx.run(model, inputs=x, targets=y, mesh=one, loss_fn=mse)
    got = spx.run(model, inputs=x, targets=y, mesh=mesh(), loss_fn=mse, schedule=S.Std1F1B(4))
    assert_close(got, want)
    forward = spx.run(model, inputs=x, mesh=mesh(), mode="forward", microbatches=4)
    assert_close(forward, spx.run(model, inputs=x, mesh=one, mode="forward"))


def test_regions_on_ranks_of_their_own_sizes_match_the_unsplit_function():
    """A vision tower on the two one-device ranks, the text tower on the ranks of 2 and 4 devices."""
    m = REGION_MICROBATCHES
    towers, text = (("vision", S.GPipe(m), 2),), ("text", S.Std1F1B(m), 2)
    loss = towers_loss(towers, text)
    params, args = tower_params(jax.random.key(0), towers, 2), batch(towers)
    ranks = {"vision": (0, 1), "text": (2, 3)}
    step = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=S.Std1F1B(m), region_ranks=ranks)
    assert_close(step(params, *args), jax.value_and_grad(loss)(params, *args))
