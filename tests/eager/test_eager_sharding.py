"""spx.sharding on a (dp, fsdp, tp) mesh of 8 CPU devices: every name resolves through
spectrax_core.sharding (the specs are compared with the core's own), `with mesh:` and
`logical_axis_rules` are the context layers read."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spectrax_core as sc
from spectrax_core.sharding import TOKENS
import spectrax_eager as spx
from spectrax_eager import sharding as shd

RULES = sc.sharding.Rules.default()


@pytest.fixture(scope="module")
def mesh():
    return spx.create_mesh((2, 2, 2), ("dp", "fsdp", "tp"))


class Block(spx.Module):
    def __init__(self):
        k1, k2 = jax.random.split(jax.random.key(0))
        self.up = spx.Parameter(jax.random.normal(k1, (8, 16)), axes=tuple(shd.ColumnWise))
        self.down = spx.Parameter(jax.random.normal(k2, (16, 8)), axes=tuple(shd.RowWise))
        self.norm = spx.Parameter(jnp.ones(8), axes=("EMBED",))
        self.count = spx.Buffer(jnp.zeros(()))

    def forward(self, x):
        x = shd.with_sharding_constraint(x, shd.HiddenStateSharding)
        return jax.nn.gelu(x @ self.up.value) @ self.down.value * self.norm.value


def test_prebuilt_names_match_the_core_specs(mesh):
    jm = mesh.jax_mesh
    for axes in (
        shd.HiddenStateSharding,
        shd.AttnQSharding,
        shd.AttnKVSharding,
        shd.ColumnWise,
        shd.RowWise,
        shd.LogitsSharding,
        shd.ExpertColumnWise,
        shd.ExpertRowWise,
        shd.ExpertActivations,
    ):
        assert shd.get_partition_spec(axes, mesh=mesh) == sc.sharding.spec(tuple(axes), RULES, mesh=jm)
    assert shd.get_partition_spec(shd.HiddenStateSharding, mesh=mesh) == P(("dp", "fsdp"), None, None)
    assert shd.get_partition_spec(shd.ColumnWise, mesh=mesh) == P("fsdp", "tp")
    assert shd.get_partition_spec(shd.AttnQSharding, mesh=mesh) == P(("dp", "fsdp"), None, "tp", None)
    assert shd.get_partition_spec(shd.Replicated, mesh=mesh) == P()
    assert shd.get_partition_spec(["EMBED", None], mesh=mesh) == P("fsdp", None)
    with shd.logical_axis_rules(RULES, mode="decode"):  # decode keeps weights whole over fsdp
        assert shd.get_partition_spec(shd.ColumnWise, mesh=mesh) == P(None, "tp")
    assert repr(shd.ColumnWise) == "ColumnWise('EMBED', 'MLP')"


def test_partition_axis_and_rules_context(mesh):
    def core_tokens(rules):  # the core's tokens of both tables (a PartitionAxis also maps EXTRA_NAMES)
        return [[(t, a) for t, a in table if t in TOKENS] for table in (rules.train, rules.decode)]

    assert core_tokens(shd.PartitionAxis().rules()) == core_tokens(RULES)
    custom = shd.PartitionAxis(hidden_state_axis=None, mlp_axis=("fsdp", "tp"))
    want = RULES.replace(EMBED=None, mode="train").replace(MLP=("fsdp", "tp"))
    assert core_tokens(custom.rules()) == core_tokens(want)
    seed_style = shd.PartitionAxis(tensor_parallel_axis="model", mlp_intermediate_axis=("fsdp", "model"))
    assert seed_style.head_axis == "model" and seed_style.mlp_axis == ("fsdp", "model")
    assert dict(seed_style.rules().train)["HEAD_DIM"] == () and dict(seed_style.rules().train)[
        "KV_LENGTH"
    ] == ("sp",)
    with pytest.raises(ValueError, match="one field"):
        shd.PartitionAxis(mlp_axis="tp", mlp_intermediate_axis="fsdp")
    assert shd.current_rules() == RULES and shd.current_mode() == "train"
    assert shd.current_axis_rules()["EMBED"] == "fsdp" and shd.current_axis_rules()["BATCH"] == ("dp", "fsdp")
    with shd.logical_axis_rules(custom) as rules:
        assert shd.current_rules() is rules and shd.current_axis_rules()["EMBED"] is None
        assert shd.get_partition_spec(shd.ColumnWise, mesh=mesh) == P(None, ("fsdp", "tp"))
        with shd.logical_axis_rules({"MLP": None}):  # adjusts the enclosing rules (EMBED stays None)
            assert shd.get_partition_spec(shd.ColumnWise, mesh=mesh) == P(None, None)
        with shd.logical_axis_rules([("MLP", None), ("EMBED", "fsdp")]):  # pairs, as a list
            assert shd.get_partition_spec(shd.ColumnWise, mesh=mesh) == P("fsdp", None)
        assert shd.current_rules() is rules
    assert shd.current_rules() == RULES
    with pytest.raises(ValueError, match="unknown mode"):
        with shd.logical_axis_rules(RULES, mode="serve"):
            pass
    with pytest.raises(TypeError, match="PartitionAxis"):
        with shd.logical_axis_rules(3):
            pass


def test_with_mesh_is_current_and_shards_a_model(mesh):
    assert shd.current_mesh() is None
    block = Block()
    x = jax.random.normal(jax.random.key(1), (4, 2, 8))
    want = jax.nn.gelu(x @ block.up.value) @ block.down.value * block.norm.value
    np.testing.assert_allclose(block(x), want, rtol=1e-5)  # no mesh: constraints are identity
    with mesh:
        assert shd.current_mesh() is mesh.jax_mesh
        shd.apply_logical_sharding(block)
        specs = shd.get_partition_spec(block)
        assert type(specs) is dict and [p for entries in specs.values() for p in entries] == [
            "up",
            "down",
            "norm",
            "count",
        ]
        core_like = {"up": P("fsdp", "tp"), "down": P("tp", "fsdp"), "norm": P("fsdp"), "count": P()}
        for path, spec in (item for _, entries in specs.items() for item in entries.items()):
            assert spec == core_like[path]
            var = getattr(block, path)
            if "axes" in var.metadata:  # placed; the others are left where they are
                assert var.value.sharding == NamedSharding(mesh.jax_mesh, spec)
                assert spec == sc.sharding.spec(var.axes, RULES, mesh=mesh.jax_mesh, shape=var.shape)
        out = spx.jit(lambda m, x: (m(x), shd.with_sharding_constraint(x * 2, ("BATCH", None, "EMBED"))))(
            block, x
        )
        np.testing.assert_allclose(out[0], want, rtol=1e-5)
        core_spec = sc.sharding.spec(("BATCH", None, "EMBED"), RULES, mesh=mesh.jax_mesh)
        assert core_spec == P(("dp", "fsdp"), None, None)  # fsdp is taken by BATCH, so EMBED stays whole
        assert out[1].sharding.is_equivalent_to(NamedSharding(mesh.jax_mesh, core_spec), 3)
        np.testing.assert_allclose(block(x), want, rtol=1e-5)  # eager, constrained on the mesh
        named = shd.get_named_sharding(shd.RowWise)
        assert named == NamedSharding(mesh.jax_mesh, P("tp", "fsdp"))
        w = shd.apply_logical_sharding(jnp.ones((16, 8)), shd.RowWise)
        assert w.sharding == named
        assert shd.get_partition_spec(w) == P("tp", "fsdp")
    assert shd.current_mesh() is None
    np.testing.assert_allclose(block(x), want, rtol=1e-5)


def test_core_params_and_errors(mesh):
    lin = sc.nn.Linear.init(jax.random.key(0), 8, 16)
    assert shd.get_partition_spec(lin, mesh=mesh) == sc.sharding.param_specs(lin, RULES, mesh=mesh.jax_mesh)
    with pytest.raises(ValueError, match="no mesh"):
        shd.get_named_sharding(shd.ColumnWise)
    with mesh:
        with pytest.raises(TypeError, match="one logical axis name"):
            shd.with_sharding_constraint(jnp.ones(2), "EMBED")
        with pytest.raises(TypeError, match="give the array's logical axes"):
            shd.apply_logical_sharding(jnp.ones(2))
    assert dataclasses.is_dataclass(shd.PartitionAxis)


def test_mpmd_mesh_as_context_nests():
    pipe = spx.create_mesh((2, 2, 2), ("pp", "fsdp", "tp"), mpmd_axis="pp")
    flat = spx.create_mesh((2, 4), ("fsdp", "tp"))
    with pipe as entered:
        assert entered is pipe and shd.current_mesh() is pipe.jax_mesh
        with flat:
            assert shd.current_mesh() is flat.jax_mesh
            assert shd.get_partition_spec(shd.ColumnWise) == P("fsdp", "tp")
        assert shd.current_mesh() is pipe.jax_mesh
        # the pipeline axis is not a rules axis: weights are laid out within a stage
        assert shd.get_partition_spec(shd.ColumnWise) == P("fsdp", "tp")
    assert shd.current_mesh() is None


def test_a_pipeline_mesh_is_named_to_the_facade_and_not_to_jax():
    """`with mesh:` of a pipeline mesh: the facade's current mesh (rules, placement of variables
    built in the block), while JAX's context mesh stays unset, so JAX code runs on an array of one
    rank's devices; a mesh without a pipeline axis is JAX's context mesh."""
    pipe = spx.create_mesh((2, 2, 2), ("pp", "fsdp", "tp"), mpmd_axis="pp")
    flat = spx.create_mesh((2, 4), ("fsdp", "tp"))
    on_rank = jax.device_put(jnp.arange(4.0), NamedSharding(pipe.submesh(1), P()))
    assert isinstance(pipe, spx.SpxMesh) and isinstance(flat, spx.sharding.SpxMesh)
    with flat, pipe:
        assert jax.sharding.get_abstract_mesh().empty and shd.current_mesh() is pipe.jax_mesh
        np.testing.assert_allclose(on_rank * 2 + 1, [1, 3, 5, 7])
        lin = spx.nn.Linear(8, 16, rngs=spx.Rngs(0))
        assert lin.weight.value.sharding == NamedSharding(pipe.jax_mesh, P("fsdp", "tp"))
        with flat:
            assert jax.sharding.get_abstract_mesh() == flat.jax_mesh.abstract_mesh
        assert shd.current_mesh() is pipe.jax_mesh
    assert shd.current_mesh() is None


def test_one_rngs_draws_under_meshes_of_different_shapes():
    """A stream's key and counter stay uncommitted, so layers built under one mesh and then
    another (sharing the `Rngs`) draw from it, and their keys go where each is used."""
    rngs = spx.Rngs(0)
    meshes = [
        spx.create_mesh((1, 8), ("dp", "fsdp")),
        spx.create_mesh((2, 4), ("dp", "fsdp")),
        spx.create_mesh((2, 1, 4), ("pp", "dp", "fsdp"), mpmd_axis="pp"),
    ]
    weights = []
    for mesh in meshes:
        with mesh:
            weights.append(spx.nn.Linear(8, 16, rngs=rngs).weight.value)
    stream = rngs.default
    assert not stream.key.value.committed and not stream.count.value.committed
    assert int(stream.count.value) == 3
    assert len({float(w.sum()) for w in weights}) == 3
