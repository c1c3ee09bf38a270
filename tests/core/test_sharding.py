"""spectrax_core.sharding: spec resolution, param_specs, named_shardings, constrain."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spectrax_core import sharding as sh
from spectrax_core.nn import Linear

RULES = sh.Rules.default()


@pytest.fixture(scope="module")
def mesh():
    """dp=2, fsdp=2, tp=2 over the 8 fake devices."""
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "fsdp", "tp"))


@pytest.fixture(scope="module")
def mesh_sp1():
    """dp=4, fsdp=2, sp=1: `sp` has size 1, `tp` and `ep` are absent."""
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2, 1), ("dp", "fsdp", "sp"))


# ---------------------------------------------------------------- spec resolution


def test_token_constants_are_their_names():
    assert sh.TOKENS == ("BATCH", "LENGTH", "EMBED", "HEAD", "KV_HEAD", "MLP", "VOCAB", "EXPERT")
    assert [getattr(sh, t) for t in sh.TOKENS] == list(sh.TOKENS)


def test_default_rules():
    train, decode = RULES.table("train"), RULES.table("decode")
    assert train == {
        "BATCH": ("dp", "fsdp"),
        "LENGTH": ("sp",),
        "EMBED": ("fsdp",),
        "HEAD": ("tp",),
        "KV_HEAD": ("tp",),
        "MLP": ("tp",),
        "VOCAB": ("tp",),
        "EXPERT": ("ep",),
    }
    assert decode == {**train, "LENGTH": (), "EMBED": ()}


def test_without_mesh_every_rule_axis_is_kept():
    assert sh.spec(("BATCH", "LENGTH", "MLP"), RULES) == P(("dp", "fsdp"), "sp", "tp")
    assert sh.spec((None, "EXPERT", "VOCAB"), RULES) == P(None, "ep", "tp")


def test_absent_and_size_one_mesh_axes_resolve_to_none(mesh_sp1):
    # sp has size 1, ep and tp are absent from the mesh.
    got = sh.spec(("BATCH", "LENGTH", "EXPERT", "HEAD"), RULES, mesh=mesh_sp1)
    assert got == P(("dp", "fsdp"), None, None, None)


def test_multi_axis_rule_gives_tuple_or_plain_name(mesh, mesh_sp1):
    assert sh.spec(("BATCH",), RULES, mesh=mesh) == P(("dp", "fsdp"))
    one_left = Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("dp", "fsdp"))
    assert sh.spec(("BATCH",), RULES, mesh=one_left) == P("dp")
    three = RULES.replace(BATCH=("dp", "fsdp", "tp"))
    assert sh.spec(("BATCH", None), three, mesh=mesh) == P(("dp", "fsdp", "tp"), None)


def test_mesh_axis_used_once_per_array(mesh):
    # BATCH takes fsdp, so EMBED (fsdp) is left unsharded.
    assert sh.spec(("BATCH", "LENGTH", "EMBED"), RULES, mesh=mesh) == P(("dp", "fsdp"), None, None)
    assert sh.spec(("EMBED", "MLP"), RULES, mesh=mesh) == P("fsdp", "tp")
    # An earlier axis takes what it can; a later one keeps only what is left.
    wide = RULES.replace(EMBED=("fsdp", "tp"))
    assert sh.spec(("EMBED", "MLP"), wide, mesh=mesh) == P(("fsdp", "tp"), None)
    assert sh.spec(("MLP", "EMBED"), wide, mesh=mesh) == P("tp", "fsdp")
    assert sh.spec(("HEAD", "KV_HEAD"), RULES, mesh=mesh) == P("tp", None)


def test_modes_differ(mesh):
    axes = ("BATCH", "LENGTH", "EMBED", "MLP")
    assert sh.spec(axes, RULES, "train") == P(("dp", "fsdp"), "sp", None, "tp")
    assert sh.spec(axes, RULES, "decode") == P(("dp", "fsdp"), None, None, "tp")
    assert sh.spec(("EMBED", "MLP"), RULES, "train", mesh) == P("fsdp", "tp")
    assert sh.spec(("EMBED", "MLP"), RULES, "decode", mesh) == P(None, "tp")


def test_active_mesh_is_used_when_mesh_is_none(mesh):
    with jax.set_mesh(mesh):
        assert sh.spec(("BATCH", "LENGTH", "EXPERT"), RULES) == P(("dp", "fsdp"), None, None)
    assert sh.spec(("LENGTH",), RULES) == P("sp")


def test_indivisible_axis_is_replicated_and_frees_its_mesh_axes(mesh):
    assert sh.spec(("VOCAB", "EMBED"), RULES, mesh=mesh, shape=(33, 16)) == P(None, "fsdp")
    assert sh.spec(("VOCAB", "EMBED"), RULES, mesh=mesh, shape=(32, 15)) == P("tp", None)
    # batch 2 does not split over dp*fsdp = 4: replicated, and fsdp goes to EMBED.
    assert sh.spec(("BATCH", "EMBED"), RULES, mesh=mesh, shape=(2, 16)) == P(None, "fsdp")
    assert sh.spec(("BATCH", "EMBED"), RULES, mesh=mesh, shape=(4, 16)) == P(("dp", "fsdp"), None)
    # Without a mesh the sizes are unknown and nothing is dropped.
    assert sh.spec(("VOCAB",), RULES, shape=(33,)) == P("tp")


def test_spec_errors():
    with pytest.raises(ValueError, match=r"unknown logical axis token 'EMBD'.*'EMBED'"):
        sh.spec(("EMBD",), RULES)
    with pytest.raises(ValueError, match=r"unknown mode 'eval'.*'train', 'decode'"):
        sh.spec(("EMBED",), RULES, mode="eval")
    with pytest.raises(TypeError, match=r"write \('EMBED',\)"):
        sh.spec("EMBED", RULES)
    with pytest.raises(TypeError, match="token"):
        sh.spec((3,), RULES)
    with pytest.raises(ValueError, match="shape"):
        sh.spec(("EMBED", "MLP"), RULES, shape=(4,))
    with pytest.raises(TypeError, match="jax.sharding.Mesh"):
        sh.spec(("EMBED",), RULES, mesh={"fsdp": 2})


# ---------------------------------------------------------------- Rules


def test_rules_are_hashable_values():
    assert hash(RULES) == hash(sh.Rules.default())
    assert RULES == sh.Rules.default()
    assert RULES.replace(EMBED="fsdp", mode="train") == RULES  # a name becomes a tuple
    assert sh.Rules() == sh.Rules(train={"EMBED": None}, decode={"MLP": ()})
    assert RULES.replace(EMBED=None) != RULES
    assert len({RULES, sh.Rules.default(), RULES.replace(EMBED=None)}) == 2


def test_rules_replace_per_mode_and_whole_tables():
    r = RULES.replace(EMBED=None, mode="train")
    assert r.mesh_axes("EMBED", "train") == ()
    assert r.mesh_axes("EMBED", "decode") == ()
    r = RULES.replace(EMBED=("fsdp", "sp"), mode="decode")
    assert r.mesh_axes("EMBED", "train") == ("fsdp",)
    assert r.mesh_axes("EMBED", "decode") == ("fsdp", "sp")
    both = RULES.replace(MLP=["tp", "ep"])
    assert both.mesh_axes("MLP", "train") == both.mesh_axes("MLP", "decode") == ("tp", "ep")
    whole = dataclasses.replace(RULES, decode={"BATCH": "dp"})
    assert whole.table("decode")["BATCH"] == ("dp",)
    assert whole.table("decode")["EMBED"] == ()  # a token not stated is not sharded


def test_rules_extra_tokens():
    r = sh.Rules.default().replace(CHANNEL=("tp",), mode="train")
    assert r.tokens == sh.TOKENS + ("CHANNEL",)
    assert sh.spec(("BATCH", "CHANNEL"), r) == P(("dp", "fsdp"), "tp")
    assert sh.spec(("CHANNEL",), r, mode="decode") == P(None)


def test_rules_errors():
    with pytest.raises(TypeError, match="'EMBED'"):
        sh.Rules(train={"EMBED": 3})
    with pytest.raises(ValueError, match="twice"):
        sh.Rules(train={"EMBED": ("fsdp", "fsdp")})
    with pytest.raises(TypeError, match="mapping"):
        sh.Rules(train=5)
    with pytest.raises(ValueError, match="unknown mode"):
        RULES.replace(mode="prefill", EMBED=None)
    with pytest.raises(ValueError, match="unknown logical axis token"):
        RULES.mesh_axes("NOPE")


# ---------------------------------------------------------------- param_specs


class _Block(eqx.Module):
    """Two Linears, a norm-like array of its own, and undeclared extras."""

    up: Linear
    down: Linear
    scale: jax.Array
    extras: dict
    pair: tuple

    def logical_axes(self):
        return {"scale": ("EMBED",)}


class _Stack(eqx.Module):
    """A stack of identical `_Block`s with a leading layer axis, plus a final Linear."""

    stacked_fields = ("layers",)
    layers: eqx.Module
    head: Linear


def _block(key, d=8, f=16):
    k1, k2 = jax.random.split(key)
    return _Block(
        up=Linear.init(k1, d, f),
        down=Linear.init(k2, f, d, use_bias=False, axes=("MLP", "EMBED")),
        scale=jnp.ones((d,)),
        extras={"step": jnp.zeros(())},
        pair=(jnp.ones((d, f)), None),
    )


BLOCK_SPECS = _Block(
    up=Linear(weight=P("fsdp", "tp"), bias=P("tp"), d_in=8, d_out=16),
    down=Linear(weight=P("tp", "fsdp"), bias=None, d_in=16, d_out=8, axes=("MLP", "EMBED")),
    scale=P("fsdp"),
    extras={"step": P()},
    pair=(P(), None),
)


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))


def test_param_specs_linear(mesh):
    lin = Linear.init(jax.random.key(0), 8, 16)
    got = sh.param_specs(lin, RULES, mesh=mesh)
    assert isinstance(got, Linear)
    assert (got.weight, got.bias) == (P("fsdp", "tp"), P("tp"))
    assert sh.param_specs(lin, RULES, "decode", mesh).weight == P(None, "tp")
    out = Linear.init(jax.random.key(0), 16, 8, use_bias=False, axes=("HEAD", "EMBED"))
    got = sh.param_specs(out, RULES, mesh=mesh)
    assert got.weight == P("tp", "fsdp") and got.bias is None


def test_param_specs_nested_module_keeps_structure(mesh):
    block = _block(jax.random.key(1))
    got = sh.param_specs(block, RULES, mesh=mesh)
    assert jax.tree_util.tree_structure(got, is_leaf=lambda x: isinstance(x, P)) == (
        jax.tree_util.tree_structure(BLOCK_SPECS, is_leaf=lambda x: isinstance(x, P))
    )
    assert _leaves(got) == _leaves(BLOCK_SPECS)
    # The same specs inside plain containers.
    got = sh.param_specs({"a": [block], "b": jnp.ones(3)}, RULES, mesh=mesh)
    assert _leaves(got["a"][0]) == _leaves(BLOCK_SPECS) and got["b"] == P()


def test_param_specs_stacked_container(mesh):
    def build(key):
        k1, k2 = jax.random.split(key)
        layers = jax.vmap(_block)(jax.random.split(k1, 3))
        return _Stack(layers=layers, head=Linear.init(k2, 8, 32, axes=("EMBED", "VOCAB")))

    stack = jax.eval_shape(build, jax.random.key(2))  # shapes suffice; nothing is computed
    assert stack.layers.up.weight.shape == (3, 8, 16)
    got = sh.param_specs(stack, RULES, mesh=mesh)
    assert got.layers.up.weight == P(None, "fsdp", "tp")
    assert got.layers.up.bias == P(None, "tp")
    assert got.layers.down.weight == P(None, "tp", "fsdp")
    assert got.layers.scale == P(None, "fsdp")
    assert got.layers.extras["step"] == P()  # undeclared: replicated
    assert got.head.weight == P("fsdp", "tp")  # outside the stack: no extra axis
    # A stack of stacks gains one leading None per level.
    outer = jax.eval_shape(
        lambda key: _Stack(layers=jax.vmap(build)(jax.random.split(key, 2)), head=build(key).head),
        jax.random.key(3),
    )
    got = sh.param_specs(outer, RULES, mesh=mesh)
    assert got.layers.layers.up.weight == P(None, None, "fsdp", "tp")
    assert got.layers.head.weight == P(None, "fsdp", "tp")
    assert got.head.weight == P("fsdp", "tp")


def test_param_specs_work_on_shape_structs(mesh):
    shapes = jax.eval_shape(lambda k: Linear.init(k, 8, 16), jax.random.key(0))
    got = sh.param_specs(shapes, RULES, mesh=mesh)
    assert (got.weight, got.bias) == (P("fsdp", "tp"), P("tp"))


def test_param_specs_replicate_indivisible_arrays(mesh):
    lin = Linear.init(jax.random.key(0), 6, 15)
    got = sh.param_specs(lin, RULES, mesh=mesh)
    assert (got.weight, got.bias) == (P("fsdp", None), P(None))
    # Without a mesh (and none active) the sizes are unknown: kept as declared.
    assert sh.param_specs(lin, RULES).weight == P("fsdp", "tp")


class _BadField(eqx.Module):
    w: jax.Array

    def logical_axes(self):
        return {"weight": ("EMBED",)}


class _BadRank(eqx.Module):
    w: jax.Array

    def logical_axes(self):
        return {"w": ("EMBED",)}


class _DeclaresModule(eqx.Module):
    inner: Linear

    def logical_axes(self):
        return {"inner": ("EMBED", "MLP")}


class _BadToken(eqx.Module):
    w: jax.Array

    def logical_axes(self):
        return {"w": ("EMBED", "MPL")}


def test_param_specs_errors():
    w = jnp.ones((4, 4))
    with pytest.raises(ValueError, match="_BadField.logical_axes.*'weight'"):
        sh.param_specs(_BadField(w=w), RULES)
    with pytest.raises(ValueError, match=r"_BadRank\.w.*1 axes.*\(4, 4\)"):
        sh.param_specs(_BadRank(w=w), RULES)
    with pytest.raises(ValueError, match=r"_DeclaresModule\.inner.*not an array"):
        sh.param_specs(_DeclaresModule(inner=Linear.init(jax.random.key(0), 4, 4)), RULES)
    with pytest.raises(ValueError, match="'MPL'"):
        sh.param_specs(_BadToken(w=w), RULES)
    with pytest.raises(ValueError, match="unknown mode"):
        sh.param_specs(_BadRank(w=jnp.ones(4)), RULES, mode="serve")


# ---------------------------------------------------------------- named_shardings / constrain


def test_named_shardings_place_arrays(mesh):
    lin = Linear.init(jax.random.key(0), 8, 16)
    shardings = sh.named_shardings(lin, RULES, mesh)
    assert shardings.weight == NamedSharding(mesh, P("fsdp", "tp"))
    placed = jax.device_put(lin, shardings)
    assert placed.weight.sharding.spec == P("fsdp", "tp")
    assert {s.data.shape for s in placed.weight.addressable_shards} == {(4, 8)}
    assert {s.data.shape for s in placed.bias.addressable_shards} == {(8,)}
    np.testing.assert_array_equal(np.asarray(placed.weight), np.asarray(lin.weight))
    with pytest.raises(TypeError, match="concrete jax.sharding.Mesh"):
        sh.named_shardings(lin, RULES, mesh.abstract_mesh)


def test_constrain_under_jit(mesh):
    x = jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16)

    @jax.jit
    def f(x):
        return sh.constrain(x * 2, ("BATCH", "LENGTH", "MLP"), RULES, mesh)

    y = f(x)
    assert y.sharding.spec == P(("dp", "fsdp"), None, "tp")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x) * 2)

    with jax.set_mesh(mesh):
        y = jax.jit(lambda x: sh.constrain(x, ("BATCH", None, "EMBED"), RULES, None, "decode"))(x)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P(("dp", "fsdp"), None, None)), 3)
    assert not y.sharding.is_equivalent_to(NamedSharding(mesh, P(("dp", "fsdp"), None, "tp")), 3)


def test_constrain_errors(mesh):
    x = jnp.ones((8, 16))
    with pytest.raises(ValueError, match=r"3 axes.*\(8, 16\)"):
        sh.constrain(x, ("BATCH", "LENGTH", "EMBED"), RULES, mesh)
    with pytest.raises(ValueError, match="active mesh"):
        sh.constrain(x, ("BATCH", "EMBED"), RULES, None)
    with pytest.raises(ValueError, match="unknown mode"):
        sh.constrain(x, ("BATCH", "EMBED"), RULES, mesh, mode="infer")


# ---------------------------------------------------------------- the real layers


def test_param_specs_real_block_stack(mesh):
    from spectrax_core.nn import BlockStack

    stack = jax.eval_shape(
        lambda key: BlockStack.init(
            key, 2, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, norm="rms", gated=True
        ),
        jax.random.key(4),
    )
    got = sh.param_specs(stack, RULES, mesh=mesh).layers
    assert got.norm1.scale == got.norm2.scale == P(None, "fsdp")
    assert got.attn.q.weight == P(None, "fsdp", "tp")
    assert got.attn.k.weight == got.attn.v.weight == P(None, "fsdp", "tp")
    assert got.attn.o.weight == P(None, "tp", "fsdp")
    assert got.mlp.gate.weight == got.mlp.up.weight == P(None, "fsdp", "tp")
    assert got.mlp.down.weight == P(None, "tp", "fsdp")
    decode = sh.param_specs(stack, RULES, "decode", mesh).layers
    assert decode.attn.o.weight == P(None, "tp", None)


def test_every_real_layer_declares_one_axis_per_array_axis(mesh):
    """Each nn layer's specs resolve, match its arrays' ranks, and divide its shapes."""
    from spectrax_core import nn

    builders = {
        "Linear": lambda k: nn.Linear.init(k, 8, 16),
        "Embed": lambda k: nn.Embed.init(k, 32, 16),
        "LayerNorm": lambda k: nn.LayerNorm.init(k, 16),
        "RMSNorm": lambda k: nn.RMSNorm.init(k, 16),
        "MLP": lambda k: nn.MLP.init(k, 16, 32),
        "GatedMLP": lambda k: nn.GatedMLP.init(k, 16, 32),
        "Attention": lambda k: nn.Attention.init(k, 16, 4, n_kv_heads=2),
        "Block": lambda k: nn.Block.init(k, 16, 4, 32),
        "BlockStack": lambda k: nn.BlockStack.init(k, 2, d_model=16, n_heads=4, d_ff=32),
        "Conv1d": lambda k: nn.Conv1d.init(k, 4, 8, 3),
        "Conv2d": lambda k: nn.Conv2d.init(k, 4, 8, 3),
        "odd sizes": lambda k: nn.Linear.init(k, 6, 15),
    }
    for name, build in builders.items():
        layer = jax.eval_shape(build, jax.random.key(5))
        arrays = jax.tree_util.tree_leaves(layer)
        shardings = jax.tree_util.tree_leaves(sh.named_shardings(layer, RULES, mesh))
        assert len(arrays) == len(shardings) > 0, name
        for array, sharding in zip(arrays, shardings):
            assert len(sharding.spec) == array.ndim, (name, array.shape, sharding.spec)
            sharding.shard_shape(array.shape)  # raises if an axis does not divide evenly


# ---------------------------------------------------------------- the sharded LM train step


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def lm_case(request):
    from spectrax_core.models import TransformerLM

    lm = TransformerLM.init(
        jax.random.key(6),
        vocab_size=32,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=32,
        tie_embeddings=request.param,
    )
    k_tok, k_tgt = jax.random.split(jax.random.key(7))
    tokens = jax.random.randint(k_tok, (8, 8), 0, 32)
    targets = jax.random.randint(k_tgt, (8, 8), 0, 32)
    return lm, tokens, targets


def _train_step(lm, tokens, targets):
    from spectrax_core.models import lm_loss

    return jax.value_and_grad(lm_loss)(lm, tokens, targets)


def test_sharded_lm_train_step_matches_one_device(mesh, lm_case):
    lm, tokens, targets = lm_case
    ref_loss, ref_grads = jax.jit(_train_step)(lm, tokens, targets)
    assert ref_loss.sharding.device_set == {jax.devices()[0]}  # the one-device reference

    shardings = sh.named_shardings(lm, RULES, mesh)
    batch = NamedSharding(mesh, sh.spec(("BATCH", "LENGTH"), RULES, mesh=mesh, shape=tokens.shape))
    assert batch.spec == P(("dp", "fsdp"), None)
    placed = jax.device_put(lm, shardings)
    tokens_s, targets_s = jax.device_put((tokens, targets), batch)

    # The parameters really are split as the rules say.
    specs = sh.param_specs(lm, RULES, mesh=mesh)
    assert specs.embed.table == P("tp", "fsdp")
    assert specs.norm.scale == P("fsdp")
    assert specs.blocks.layers.attn.q.weight == P(None, "fsdp", "tp")
    assert specs.blocks.layers.attn.o.weight == P(None, "tp", "fsdp")
    assert specs.blocks.layers.mlp.down.weight == P(None, "tp", "fsdp")
    if lm.head is None:
        assert specs.head is None
    else:
        assert specs.head.weight == P("fsdp", "tp")
    assert placed.embed.table.addressable_shards[0].data.shape == (16, 8)
    assert placed.blocks.layers.attn.q.weight.addressable_shards[0].data.shape == (2, 8, 8)
    for array, s in zip(jax.tree_util.tree_leaves(placed), _leaves(specs), strict=True):
        assert array.sharding.spec == s

    step = jax.jit(
        _train_step,
        in_shardings=(shardings, batch, batch),
        out_shardings=(NamedSharding(mesh, P()), shardings),
    )
    compiled = step.lower(placed, tokens_s, targets_s).compile()
    hlo = compiled.as_text()
    assert "all-reduce" in hlo or "reduce-scatter" in hlo  # the work really is distributed
    loss, grads = compiled(placed, tokens_s, targets_s)

    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref_grads)
    leaves = jax.tree_util.tree_leaves
    for g, ref, s in zip(leaves(grads), leaves(ref_grads), _leaves(specs), strict=True):
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-6)
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, s), g.ndim), (g.sharding, s)
        assert len(g.sharding.device_set) == 8
