"""Bad input: explicit shape checks always, jaxtyping+beartype checks when switched on."""

import re

import jax
import jax.numpy as jnp
import jaxtyping
import pytest

import spectrax_core as sc
from spectrax_core import losses, nn
from spectrax_core.models import TransformerLM, lm_loss
from spectrax_core.nn import _norm

KEY = jax.random.key(0)


def _abstract(init):
    """Shape-only params: the checks under test run before any arithmetic, so no values are needed."""
    return jax.eval_shape(init)


@pytest.fixture
def checks_on(monkeypatch):
    """Runtime checks on for one test; the environment variable is restored afterwards."""
    monkeypatch.delenv("SPECTRAX_RUNTIME_CHECKS", raising=False)
    sc.enable_runtime_checks()
    yield
    sc.enable_runtime_checks(False)


FEATURES = r"expected input with {what} = {n} on the last axis, received shape {shape}"
RANK = r"expected an input of rank {n} laid out as {layout}, received shape {shape}"

BAD_INPUTS = {
    "Linear": (lambda: nn.Linear.init(KEY, 4, 3), (2, 5), FEATURES, dict(what="features", n=4)),
    "LayerNorm": (lambda: nn.LayerNorm.init(None, 4), (3,), FEATURES, dict(what="features", n=4)),
    "RMSNorm": (lambda: nn.RMSNorm.init(None, 4), (2, 6), FEATURES, dict(what="features", n=4)),
    "MLP": (lambda: nn.MLP.init(KEY, 4, 8), (2, 8), FEATURES, dict(what="features", n=4)),
    "GatedMLP": (lambda: nn.GatedMLP.init(KEY, 4, 8), (2, 3), FEATURES, dict(what="features", n=4)),
    "Attention": (
        lambda: nn.Attention.init(KEY, 4, 2),
        (2, 4),
        RANK,
        dict(n=3, layout="(batch, length, d_model)"),
    ),
    "Block": (lambda: nn.Block.init(KEY, 4, 2, 8), (1, 2, 3), FEATURES, dict(what="features", n=4)),
    "BlockStack": (
        lambda: nn.BlockStack.init(KEY, 2, d_model=4, n_heads=2, d_ff=8),
        (2, 4),
        RANK,
        dict(n=3, layout="(batch, length, d_model)"),
    ),
    "Conv1d": (lambda: nn.Conv1d.init(KEY, 3, 2, 2), (4, 3), RANK, dict(n=3, layout="(batch, width, c_in)")),
    "Conv2d": (lambda: nn.Conv2d.init(KEY, 3, 2, 2), (1, 4, 4, 2), FEATURES, dict(what="channels", n=3)),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_wrong_rank_or_feature_size_names_layer_and_shapes(name):
    init, shape, template, fields = BAD_INPUTS[name]
    layer = _abstract(init)  # the check runs before any arithmetic, so shapes suffice
    escaped = {k: re.escape(str(v)) for k, v in fields.items()}
    message = name + ": " + template.format(shape=re.escape(str(shape)), **escaped)
    with pytest.raises(ValueError, match=message):
        sc.apply(layer, jnp.ones(shape))


def test_embed_and_lm_input_errors():
    emb = _abstract(lambda: nn.Embed.init(KEY, 5, 4))
    with pytest.raises(TypeError, match=r"Embed: tokens must be an integer array, received dtype float32"):
        sc.apply(emb, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Embed.attend: .*features = 4 .* received shape \(2, 3\)"):
        nn.attend(emb, jnp.ones((2, 3)))
    lm = _abstract(lambda: TransformerLM.init(KEY, vocab_size=8, d_model=8, n_layers=1, n_heads=2, d_ff=8))
    with pytest.raises(
        ValueError, match=r"TransformerLM: expected an input of rank 2 .* received shape \(6,\)"
    ):
        sc.apply(lm, jnp.zeros((6,), jnp.int32))


def test_attention_mask_and_hyper_parameter_errors():
    attn = _abstract(lambda: nn.Attention.init(KEY, 4, 2))
    x = jnp.ones((2, 3, 4))
    with pytest.raises(TypeError, match="mask must be boolean"):
        sc.apply(attn, x, mask=jnp.ones((2, 1, 3, 3)))
    with pytest.raises(
        ValueError, match=r"mask of shape \(2, 1, 1, 4\) does not broadcast to .* \(2, 2, 3, 3\)"
    ):
        sc.apply(attn, x, mask=jnp.ones((2, 1, 1, 4), bool))
    with pytest.raises(ValueError, match="n_heads=4 must be a multiple of n_kv_heads=3"):
        nn.Attention.init(KEY, 8, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="d_model=6 is not divisible by n_heads=4"):
        nn.Attention.init(KEY, 6, 4)
    with pytest.raises(ValueError, match="rope=True needs an even head_dim"):
        nn.Attention.init(KEY, 6, 2, rope=True)
    with pytest.raises(ValueError, match="norm must be one of"):
        nn.Block.init(KEY, 4, 2, 8, norm="batch")


def test_runtime_checks_off_by_default(monkeypatch):
    monkeypatch.delenv("SPECTRAX_RUNTIME_CHECKS", raising=False)
    assert not sc.runtime_checks_enabled()
    # Without the checker, a (1,)-shaped scale silently broadcasts over d=4.
    assert _norm._rms_norm(jnp.ones((2, 4)), jnp.ones((1,)), 1e-6).shape == (2, 4)


def test_runtime_checks_catch_mismatched_dims(checks_on):
    assert sc.runtime_checks_enabled()
    with pytest.raises(jaxtyping.TypeCheckError, match="scale"):
        _norm._rms_norm(jnp.ones((2, 4)), jnp.ones((1,)), 1e-6)
    with pytest.raises(jaxtyping.TypeCheckError):
        losses.mse(jnp.ones(3, jnp.int32), jnp.ones(3, jnp.int32))


def test_runtime_checks_accept_valid_models(checks_on):
    """Every typed math function of the LM, its gradient, a conv and dropout trace cleanly with checks on.

    Tracing (`eval_shape`) runs the jaxtyping+beartype checks without compiling anything.
    """
    lm = _abstract(
        lambda: TransformerLM.init(KEY, vocab_size=8, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=8)
    )
    tokens = jnp.zeros((2, 4), jnp.int32)
    loss, grads = jax.eval_shape(jax.value_and_grad(lm_loss), lm, tokens, tokens)
    assert loss.shape == () and jax.tree.structure(grads) == jax.tree.structure(lm)
    x = jnp.ones((1, 5, 3))
    conv = _abstract(lambda: nn.Conv1d.init(KEY, 3, 2, 3, stride=2))
    assert jax.eval_shape(sc.apply, conv, x).shape == (1, 3, 2)
    assert jax.eval_shape(lambda v: sc.apply(nn.Dropout(rate=0.5), v, key=KEY), x).shape == x.shape
