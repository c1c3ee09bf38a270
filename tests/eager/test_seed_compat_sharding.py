"""Sharding annotations are metadata resolved late: a model written with any logical names builds
without a mesh and is placed under `with mesh, logical_axis_rules([...])`; typos are caught once
a mesh and rules are active; the mesh helpers of `spx.sharding`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spectrax_eager as spx
from spectrax_eager import nn
from spectrax_eager.sharding import (
    current_axis_rules,
    get_named_sharding,
    get_partition_spec,
    logical_axis_rules,
    with_sharding_constraint_by_name,
)

PAIRS = [("fsdp", "fsdp"), ("tp_head", "tp"), ("batch", ("dp", "fsdp"))]


class Attn(spx.Module):
    def __init__(self, d, heads, rngs):
        self.heads = heads
        kw = dict(use_bias=False, rngs=rngs)
        self.q = nn.Linear(d, d, sharding=("fsdp", "tp_head"), **kw)
        self.k = nn.Linear(d, d, sharding=("fsdp", "tp_head"), **kw)
        self.v = nn.Linear(d, d, sharding=("fsdp", "tp_head"), **kw)
        self.o = nn.Linear(d, d, sharding=("tp_head", "fsdp"), **kw)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (m(x).reshape(b, t, self.heads, d // self.heads) for m in (self.q, self.k, self.v))
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5, -1)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, d))


class LlamaBlock(spx.Module):
    def __init__(self, d=16, heads=4, ff=32, rngs=None):
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attn = Attn(d, heads, rngs)
        self.gate = nn.Linear(d, ff, use_bias=False, sharding=("fsdp", "tp_head"), rngs=rngs)
        self.up = nn.Linear(d, ff, use_bias=False, sharding=("fsdp", "tp_head"), rngs=rngs)
        self.down = nn.Linear(ff, d, use_bias=False, sharding=("tp_head", "fsdp"), rngs=rngs)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


@pytest.fixture(scope="module")
def mesh():
    return spx.create_mesh((1, 2, 4), ("dp", "fsdp", "tp"))


def _reference(block, x):
    """The block's output computed with plain jax.numpy from its weights (no layers involved)."""
    w = {p: np.asarray(v) for _, p, v in spx.tree_state(block).items()}

    def rms(h, scale):
        return h / np.sqrt(np.mean(h**2, -1, keepdims=True) + 1e-6) * scale

    b, t, d = x.shape
    h = rms(x, w["norm1.scale"])
    q, k, v = (h @ w[f"attn.{n}.weight"] for n in "qkv")
    q, k, v = (a.reshape(b, t, 4, d // 4) for a in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / (d // 4) ** 0.5
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    x = x + np.einsum("bhqk,bkhd->bqhd", s, v).reshape(b, t, d) @ w["attn.o.weight"]
    h = rms(x, w["norm2.scale"])
    gate = h @ w["gate.weight"]
    return x + ((gate / (1 + np.exp(-gate))) * (h @ w["up.weight"])) @ w["down.weight"]


def test_llama_block_builds_without_mesh_and_places_under_mesh_and_pairs(mesh):
    block = LlamaBlock(rngs=spx.Rngs(0))  # no mesh: names are only recorded
    assert block.attn.q.weight.axes == ("fsdp", "tp_head") and block.down.weight.axes == ("tp_head", "fsdp")
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    want = _reference(block, np.asarray(x, np.float64))
    np.testing.assert_allclose(block(x), want, rtol=1e-5, atol=1e-5)
    with mesh, logical_axis_rules(PAIRS):
        specs = get_partition_spec(block)
        assert specs["parameters"]["attn.q.weight"] == P("fsdp", "tp")
        assert specs["parameters"]["attn.o.weight"] == P("tp", "fsdp")
        assert specs["parameters"]["norm1.scale"] == P("fsdp")  # the core names keep their rules (EMBED)
        shardings = get_named_sharding(block, mesh)
        assert shardings["parameters"]["down.weight"] == NamedSharding(mesh.jax_mesh, P("tp", "fsdp"))
        spx.sharding.apply_logical_sharding(block)
        got = spx.jit(lambda m, x: m(x))(block, x)
    assert block.attn.q.weight.value.sharding.spec == P("fsdp", "tp")
    assert block.up.weight.value.sharding.spec == P("fsdp", "tp")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rules_as_pairs_or_mapping_nest_over_the_enclosing_block(mesh):
    lin = nn.Linear(8, 16, sharding=("embed", "mlp"), rngs=spx.Rngs(0))
    with mesh:
        with logical_axis_rules([("embed", "fsdp"), ("mlp", "tp")]):
            assert get_partition_spec(lin)["parameters"]["weight"] == P("fsdp", "tp")
            with logical_axis_rules({"mlp": None}):  # overrides one name, keeps the other
                assert get_partition_spec(lin)["parameters"]["weight"] == P("fsdp", None)
                assert current_axis_rules()["embed"] == "fsdp" and current_axis_rules()["mlp"] is None
            with logical_axis_rules([("embed", ("dp", "fsdp"))]):
                assert current_axis_rules()["embed"] == ("dp", "fsdp")
        assert "embed" not in current_axis_rules()
    with pytest.raises(TypeError, match="pair"):
        with logical_axis_rules([("embed", "fsdp", "tp")]):
            pass


def test_typos_are_errors_once_a_mesh_and_rules_are_active(mesh):
    lin = nn.Linear(8, 16, sharding=("fsdp", "tp_hed"), rngs=spx.Rngs(0))  # built: nothing resolved
    assert get_partition_spec(lin)["parameters"]["weight"] == P(None, None)  # no mesh, no rules
    with mesh:  # a mesh without rules: mesh axis names stand for themselves, others stay whole
        assert get_partition_spec(lin)["parameters"]["weight"] == P("fsdp", None)
        with logical_axis_rules(PAIRS):
            with pytest.raises(ValueError, match="unknown logical axis token 'tp_hed'.*no axis of that name"):
                get_partition_spec(lin)
            with pytest.raises(ValueError, match="'tp_hed'"):
                nn.Linear(8, 16, sharding=("fsdp", "tp_hed"), rngs=spx.Rngs(0))  # placed when built
    with pytest.raises(ValueError, match="names 1 axes but the array has 2"):
        nn.Linear(8, 16, sharding=("fsdp",), rngs=spx.Rngs(0))


def test_constraint_by_name_and_per_array_annotations(mesh):
    x = jnp.ones((4, 16))
    assert with_sharding_constraint_by_name(x, ("batch", "embed")) is x  # no mesh: unchanged
    with mesh, logical_axis_rules(PAIRS + [("embed", "tp")]):
        y = jax.jit(lambda a: with_sharding_constraint_by_name(a, ("batch", "embed")))(x)
        block = nn.MLPBlock(
            16, 32, fc1_sharding=("embed", "tp_head"), fc2_bias_sharding=("embed",), rngs=spx.Rngs(0)
        )
    assert y.sharding.spec == P("fsdp", "tp")  # batch: dp is of size 1
    assert block.fc1.weight.axes == ("embed", "tp_head") and block.fc1.weight.value.sharding.spec == P(
        "tp", None
    )
    assert block.fc2.bias.axes == ("embed",)


def test_mesh_helpers():
    assert spx.sharding.calculate_host_mesh_shape((2, 8), total_devices=4, num_processes=4) == (1, 4)
    mesh = spx.sharding.parse_mesh_from_string("fsdp:2,tp:4", ("fsdp", "tp"))
    assert mesh.shape == {"fsdp": 2, "tp": 4} and spx.create_mesh().shape["fsdp"] == 8
    with spx.sharding.use_mesh(mesh):
        assert spx.sharding.names_in_current_mesh("fsdp", "tp") and not spx.sharding.names_in_current_mesh(
            "dp"
        )
        assert spx.sharding.get_axes_size_in_mesh(("fsdp", "tp")) == 8
        fit = spx.sharding.sanitize_partition_spec_for_mesh_and_shape(P(("fsdp", "dp"), "tp"), shape=(6, 3))
        assert fit == P("fsdp", None)  # dp is not a mesh axis; 3 is not divisible by tp=4
    tree = {"w": jnp.ones((8, 4)), "b": jnp.ones(4), "s": jnp.ones(())}
    specs = spx.sharding.match_partition_rules([("w", P("fsdp", "tp")), (".*", P())], tree)
    assert specs == {"w": P("fsdp", "tp"), "b": P(), "s": P()}
    with pytest.raises(ValueError, match="no rule matches"):
        spx.sharding.match_partition_rules([("w", P())], tree)
    shard, gather = spx.sharding.make_shard_and_gather_fns(specs, mesh)
    placed = jax.tree.map(lambda f, a: f(a), shard, tree)
    assert placed["w"].sharding.spec == P("fsdp", "tp")
    assert spx.sharding.extract_shardings(placed)["w"] == placed["w"].sharding
    np.testing.assert_array_equal(gather["w"](placed["w"]), tree["w"])


def test_setup_placement_names_the_leaf_that_does_not_fit():
    mesh = jax.make_mesh((8,), ("x",))
    tree = {"a": jnp.ones((8, 2)), "b": jnp.ones((3,))}
    ok = {"a": NamedSharding(mesh, P("x")), "b": NamedSharding(mesh, P())}
    counts: dict = {}
    placed = spx.place_setup_tree_with_shardings(tree, ok)
    assert placed["a"].sharding.spec == P("x")
    spx.sharding.place_setup_leaf_with_sharding(tree["a"], ok["a"], diagnostics=counts)
    assert counts == {"placed": 1}
    with pytest.raises(ValueError, match="setup: cannot place b of shape"):
        spx.place_setup_tree_with_shardings(tree, {**ok, "b": NamedSharding(mesh, P("x"))}, label="setup")
