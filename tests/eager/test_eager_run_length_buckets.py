"""`spx.run(..., length_buckets=)`: an eager model's long-tailed batch run as microbatches padded
only to their length bucket gives the padded batch's loss and gradients (`spx.value_and_grad`
on one device), and with `optimizer=` the same update as `opt.update` after it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_eager._pipeline import run as eager_run

VOCAB, D, PADDED = 11, 8, 16
LENGTHS = np.asarray([16, 3, 2, 5, 1, 9, 2, 4], np.int32)  # microbatches of 2 rows at 16, 8, 4, 2
BUCKETS = mp.LengthBuckets(("targets", "lengths"))


class Net(spx.Module):
    """Per-token layers: a row's positions past its length change nothing before them."""

    def __init__(self, rngs):
        self.embed = spx.nn.Embed(VOCAB, D, rngs=rngs)
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(D, D, rngs=rngs) for _ in range(2)])
        self.head = spx.nn.Linear(D, VOCAB, rngs=rngs)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = jnp.tanh(block(h))
        return self.head(h)


def token_mean(logits, targets):
    """Cross-entropy averaged over every row's real tokens (`targets["lengths"]` of them)."""
    labels, lengths = targets["labels"], targets["lengths"]
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
    mask = (jnp.arange(logits.shape[1])[None] < lengths[:, None]).astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (len(LENGTHS), PADDED)).astype(np.int32)
    labels = rng.integers(0, VOCAB, (len(LENGTHS), PADDED)).astype(np.int32)
    return tokens, {"labels": labels, "lengths": LENGTHS}


def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def last_lengths(step: str) -> list:
    """The microbatch lengths the last run's plan ran (`step`: its gradient or update step)."""
    runner = next(reversed(eager_run._runners.values()))[0]
    return sorted(getattr(runner, step).last_entry.lengths)


def bucketed_run(model, tokens, targets, **more):
    """`spx.run` of `token_mean` in 4 microbatches, each at its length bucket."""
    settings = {"mesh": mesh(), "loss_fn": token_mean, "microbatches": 4, "length_buckets": BUCKETS} | more
    return spx.run(model, inputs=tokens, targets=targets, **settings)


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_gradients_are_the_padded_batch_s():
    model, (tokens, targets) = Net(spx.Rngs(0)), batch()
    want, want_grads = spx.value_and_grad(lambda m: token_mean(m(tokens), targets))(model)
    value, grads = bucketed_run(model, tokens, targets)
    close(value, want)
    close(grads, want_grads)
    assert last_lengths("step") == [2, 4, 8, 16]


def test_optimizer_step_is_the_padded_batch_s():
    (tokens, targets), model, reference = batch(), Net(spx.Rngs(0)), Net(spx.Rngs(0))
    opt, ref_opt = spx.Optimizer(model, optax.adam(1e-2)), spx.Optimizer(reference, optax.adam(1e-2))
    value = bucketed_run(model, tokens, targets, optimizer=opt)
    want, grads = spx.value_and_grad(lambda m: token_mean(m(tokens), targets))(reference)
    ref_opt.update(reference, grads)
    close(value, want)
    close(spx.tree_state(model), spx.tree_state(reference))
    close(spx.tree_state(opt), spx.tree_state(ref_opt))
    assert last_lengths("update_step") == [2, 4, 8, 16]


def test_a_mesh_without_a_pipeline_axis_refuses_it():
    model, (tokens, targets) = Net(spx.Rngs(0)), batch()
    spmd = mp.create_mesh((1, 2, 1, 1, 1, 1), devices=jax.devices()[:2])
    with pytest.raises(mp.MpmdError, match="length_buckets .* no pipeline axis"):
        bucketed_run(model, tokens, targets, mesh=spmd)


def test_a_model_with_rngs_streams_refuses_it():
    """Its streams' counters come back per microbatch, outputs beside the loss."""
    from run_rngs_worker import Net as Dropping  # a model with a dropout stream

    x = np.zeros((8, 8), np.float32)
    with pytest.raises(mp.MpmdError, match="Rngs streams"):
        bucketed_run(
            Dropping(), x, {"y": x, "lengths": LENGTHS}, loss_fn=lambda out, t: jnp.mean(out - t["y"])
        )
