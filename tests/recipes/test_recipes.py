"""Training scripts as users write them, pipelined on two ranks, against the unsplit step (one
`jax.jit` on one device) over five steps, for two schedules.

Where a computation depends on the microbatch by its nature (a mixture-of-experts load
balancing term, bfloat16 rounding of each microbatch's matmuls) the reference is the same
computation microbatched on one device, and the docs say so. All but the padded mean are
marked slow (about 10 s each on two cores): the quick loop keeps one recipe.
"""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from recipes import BATCH, LENGTH, M, MESH, SCHEDULES, batches, close, init, logits, token_losses, train

import spectrax_mpmd as mp

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))


def _one_plan_and_unsplit(loss, tx=TX, **kwargs):
    """The one-plan pipelined step of `loss` and the same step as one `jax.jit`."""

    def unsplit(params, opt_state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    def pipelined(schedule):
        return mp.sxvalue_and_grad_and_apply(loss, tx, mesh=MESH, schedule=schedule, **kwargs)

    return pipelined, jax.jit(unsplit)


def _padding(seed: int):
    """Per-row lengths of real tokens; whole microbatches of padding included."""
    lengths = jax.random.randint(jax.random.key(seed), (BATCH,), 0, LENGTH + 1).at[:2].set(0)
    return (jnp.arange(LENGTH)[None, :] < lengths[:, None]).astype(jnp.float32)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_padded_token_mean(schedule):
    def loss(p, tokens, targets, mask):
        return jnp.sum(token_losses(p, tokens, targets) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    pipelined, unsplit = _one_plan_and_unsplit(loss)
    params = init(jax.random.key(0))
    data = [(*b, _padding(k)) for k, b in enumerate(batches())]
    train(pipelined(SCHEDULES[schedule]), unsplit, (params, TX.init(params)), data)


def _packed(seed: int):
    """Segment ids of a packed batch (0: padding) and the causal in-segment averaging."""
    cuts = jax.random.randint(jax.random.key(seed), (BATCH, LENGTH), 0, 3)
    segments = jnp.cumsum(cuts == 0, axis=1) * (jnp.arange(LENGTH) < LENGTH - (cuts[:, :1] == 2))
    same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)
    causal = same & (jnp.arange(LENGTH)[:, None] >= jnp.arange(LENGTH)[None, :])
    return segments, causal / jnp.maximum(causal.sum(-1, keepdims=True), 1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_packed_sequences_with_segment_ids(schedule):
    def loss(p, tokens, targets, segments, mix):
        real = segments > 0
        return jnp.sum(token_losses(p, tokens, targets, mix) * real) / jnp.sum(real)

    pipelined, unsplit = _one_plan_and_unsplit(loss)
    params = init(jax.random.key(1))
    data = [(*b, *_packed(k)) for k, b in enumerate(batches(1))]
    train(pipelined(SCHEDULES[schedule]), unsplit, (params, TX.init(params)), data)


def _mean_loss(p, tokens, targets):
    return jnp.mean(token_losses(p, tokens, targets))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_frozen_base_by_a_python_mask_with_donation(schedule):
    """LoRA-style: only `w2` and `head` train; the frozen leaves are returned as they came, by a
    hand-written step that donates its parameters and state."""
    trainable = {"embed": False, "w1": False, "w2": True, "head": True}
    tx = optax.adam(1e-2)
    grads_of = mp.sxvalue_and_grad(_mean_loss, mesh=MESH, schedule=SCHEDULES[schedule])

    def update(params, opt_state, loss, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        return loss, {k: new[k] if trainable[k] else params[k] for k in params}, opt_state

    @functools.partial(mp.sxjit, mesh=MESH, donate_argnums=(0, 1))
    def pipelined(params, opt_state, tokens, targets):
        return update(params, opt_state, *grads_of(params, tokens, targets))

    @jax.jit
    def unsplit(params, opt_state, tokens, targets):
        return update(params, opt_state, *jax.value_and_grad(_mean_loss)(params, tokens, targets))

    params = init(jax.random.key(2))
    train(pipelined, unsplit, (params, tx.init(params)), batches(2))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_multisteps_accumulation(schedule):
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    pipelined, unsplit = _one_plan_and_unsplit(_mean_loss, tx=tx)
    params = init(jax.random.key(3))
    train(pipelined(SCHEDULES[schedule]), unsplit, (params, tx.init(params)), batches(3))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parameter_ema(schedule):
    grads_of = mp.sxvalue_and_grad(_mean_loss, mesh=MESH, schedule=SCHEDULES[schedule])

    def update(params, opt_state, ema, loss, grads):
        updates, opt_state = TX.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, params)
        return loss, params, opt_state, ema

    @functools.partial(mp.sxjit, mesh=MESH, donate_argnums=(0, 1, 2))
    def pipelined(params, opt_state, ema, tokens, targets):
        return update(params, opt_state, ema, *grads_of(params, tokens, targets))

    @jax.jit
    def unsplit(params, opt_state, ema, tokens, targets):
        return update(params, opt_state, ema, *jax.value_and_grad(_mean_loss)(params, tokens, targets))

    params = init(jax.random.key(4))
    train(pipelined, unsplit, (params, TX.init(params), params), batches(4))


def _microbatched(loss):
    """`loss` over the batch as the pipeline computes it: the mean over `M` microbatches, the
    broadcast key folded with each microbatch's index (the unsplit form of a per-microbatch
    computation)."""

    def total(params, tokens, targets, key):
        size = tokens.shape[0] // M
        parts = [
            loss(params, tokens[i * size : (i + 1) * size], targets[i * size : (i + 1) * size], jax.random.fold_in(key, i))
            for i in range(M)
        ]
        return jnp.mean(jnp.stack(parts))

    return total


def _dropout_loss(p, tokens, targets, key):
    h = p["embed"][tokens]
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0)
    h = h + jnp.tanh(h @ p["w1"])
    h = mp.sxstage_iter(h)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], targets))


def _moe_loss(p, tokens, targets, key):
    """Top-1 routing over two experts (`w1`, `w2`) with a load-balancing term: the fraction of
    tokens each expert takes depends on the tokens in the (micro)batch."""
    h = p["embed"][tokens]
    router = jax.nn.softmax(h @ p["head"][:, :2], axis=-1)
    choice = jax.nn.one_hot(jnp.argmax(router, axis=-1), 2)
    experts = jnp.stack([jnp.tanh(h @ p["w1"]), jnp.tanh(h @ p["w2"])], axis=-2)
    h = h + jnp.sum(experts * (choice * router)[..., None], axis=-2)
    h = mp.sxstage_iter(h)
    balance = 2 * jnp.sum(jnp.mean(choice, axis=(0, 1)) * jnp.mean(router, axis=(0, 1)))
    ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ p["head"], targets))
    return ce + 0.01 * balance


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("loss", [_dropout_loss, _moe_loss], ids=["dropout", "moe_aux_loss"])
def test_per_microbatch_computations(schedule, loss):
    """Dropout (the key folded per microbatch) and an MoE layer's load-balancing loss against
    the same microbatches computed one by one on one device. The balance term is a product of two
    means over the microbatch's tokens, per microbatch by nature: the step declares the mean of
    the microbatch losses (`reduce="mean"`; without it the loss is refused, not averaged)."""
    pipelined = _one_plan_and_unsplit(loss, batch_argnums=(1, 2), reduce="mean")[0]
    reference = _one_plan_and_unsplit(_microbatched(loss))[1]
    params = init(jax.random.key(5))
    data = [(*b, jax.random.key(10 + k)) for k, b in enumerate(batches(5))]
    train(pipelined(SCHEDULES[schedule]), reference, (params, TX.init(params)), data)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_compute_with_float32_master_weights(schedule):
    """bfloat16 compute over float32 master weights: against the microbatched computation at
    float32 accuracy (each microbatch's bfloat16 matmuls are the same), and against the unsplit
    step at bfloat16 accuracy (rounding differs with the batch split)."""

    def loss(master, tokens, targets, key):
        p = jax.tree.map(lambda w: w.astype(jnp.bfloat16), master)
        out = logits(p, tokens).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, targets))

    pipelined, unsplit = _one_plan_and_unsplit(loss, batch_argnums=(1, 2))
    reference = _one_plan_and_unsplit(_microbatched(loss))[1]
    params = init(jax.random.key(6))
    data = [(*b, jax.random.key(0)) for b in batches(6)]
    train(pipelined(SCHEDULES[schedule]), reference, (params, TX.init(params)), data)
    train(pipelined(SCHEDULES[schedule]), unsplit, (params, TX.init(params)), data, compare=_bf16_close)


def _bf16_close(got, want):
    """Losses to bfloat16 accuracy, parameters to 1% of their norm (Adam's normalised steps turn
    rounding differences of near-zero gradients into differences of a learning rate)."""
    close(got[0], want[0], rtol=1e-2)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        assert float(jnp.linalg.norm(a - b)) <= 1e-2 * float(jnp.linalg.norm(b))
