"""The seed library's behaviours as specifications: a Variable read as its value, the two forms
of `spx.scan`, `MultiheadAttention`'s result, a selector partitioning a State, the MPMD
mesh's stage-local names, `StagesArray`, DualPipeV's task list and the regions of a jaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, PartitionSpec

import spectrax_eager as spx
from spectrax_eager import nn
from spectrax_eager.contrib import MultiOptimizer
from spectrax_eager.runtime import (
    FusedTask,
    StagesArray,
    abstract_stages_array,
    dualpipev_tasks,
    stage_region_specs,
)
from spectrax_eager.runtime.types import MpMdMesh


def test_a_variable_reads_as_its_value():
    v = spx.Parameter(jnp.arange(4.0))
    np.testing.assert_allclose(v * 2 - 1, [-1, 1, 3, 5])
    np.testing.assert_allclose(jnp.ones(4) @ v, 6.0)
    assert int(spx.Buffer(jnp.asarray(3))) == 3 and float(v[1]) == 1.0 and np.asarray(v).shape == (4,)
    assert jnp.sum(v) == 6.0 and range(5)[spx.Buffer(jnp.asarray(2))] == 2
    assert v != spx.Parameter(jnp.arange(4.0)) and len({v, v}) == 1  # still compared as cells
    assert spx.Variable(jnp.ones(2)).kind == "buffers"
    opt = spx.Optimizer(nn.Linear(2, 2, rngs=spx.Rngs(0)), optax.sgd(0.1))
    assert int(opt.step) == 0


def test_scan_takes_the_seed_form_and_the_lax_form():
    lin = nn.Linear(3, 3, rngs=spx.Rngs(0))
    xs = jnp.ones((4, 2, 3))
    ys = spx.scan(lambda m, x: m(x), lin, xs)
    np.testing.assert_allclose(ys, jax.vmap(lin)(xs), rtol=1e-6)
    carry, ys2 = spx.scan(lambda m, x: (m, m(x)), lin, xs)
    assert carry is lin
    np.testing.assert_allclose(ys2, ys)
    assert spx.remat_scan(lambda m, x: m(x).sum(), lin, xs).shape == (4,)


def test_attention_returns_the_output_for_every_call_and_the_pair_when_asked():
    attn = nn.MultiheadAttention(4, 2, rngs=spx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))
    y = attn(x)
    assert isinstance(y, jax.Array) and y.shape == (2, 3, 4)
    for out in (
        attn(x, x),
        attn(x, x, x),
        attn(x, x, x, need_weights=False),
        attn(x, mask=jnp.ones((3, 3), bool)),
    ):
        assert isinstance(out, jax.Array)
        np.testing.assert_allclose(out, y, rtol=1e-6)
    pair = attn(x, x, x, need_weights=True)
    assert isinstance(pair, tuple) and pair[1].shape == (2, 3, 3)
    np.testing.assert_allclose(pair[0], y, rtol=1e-6)


def test_selector_partitions_a_state_and_optimizers_expose_their_parts():
    model = nn.Sequential(nn.Linear(2, 3, rngs=spx.Rngs(0)), nn.Linear(3, 1, rngs=spx.Rngs(1)))
    sel = spx.path_startswith("1")
    picked, rest = sel.partition_state(model, spx.tree_state(model))
    assert [p for _, p in picked.paths()] == ["1.weight", "1.bias"]
    assert [p for _, p in rest.paths()] == ["0.weight", "0.bias"]
    assert len(spx.select().variables("parameters").apply(model)) == 4
    lora = nn.wrap_lora(nn.Linear(2, 2, rngs=spx.Rngs(0)), 1, rngs=spx.Rngs(1))
    assert lora.lora_a is lora.a and lora.lora_b is lora.b and lora.base_module is lora.base
    multi = MultiOptimizer(lora, {"lora": optax.sgd(1.0), "parameters": optax.sgd(0.1)})
    assert [type(o).__name__ for o in multi.subs] == ["Optimizer", "Optimizer"]


def test_mpmd_mesh_names_and_stages_array():
    mm = MpMdMesh(Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("pp", "tp")), "pp")
    assert (mm.mpmd_dim, mm.mpmd_axis_name, mm.spmd_axis_names) == (2, "pp", ("tp",))
    assert [sorted(d.id for d in m.devices.flat) for m in mm.unstack()] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mm.sub_sharding(1, ("tp",)).spec == PartitionSpec("tp") and mm.mpmd_mesh is mm
    with pytest.raises(ValueError, match="pipeline axis 'pp'"):
        mm.sub_sharding(0, PartitionSpec("pp"))
    arr = StagesArray({1: jnp.ones(2), 0: jnp.zeros(2)})
    assert list(arr.shards) == [0, 1] and arr.mpmd_idxs == {0, 1} and 1 in arr and len(arr) == 2
    np.testing.assert_allclose(arr.reduce_sum(), [1.0, 1.0])
    with pytest.raises(ValueError, match="one shape"):
        StagesArray({0: jnp.ones(2), 1: jnp.ones(3)})
    with pytest.raises(ValueError, match="exactly one shard"):
        arr.to_local_array()
    assert abstract_stages_array((2,), jnp.float32, [2, 0, 2]).mpmd_idxs == {0, 2}


def test_dualpipev_tasks_and_stage_region_specs():
    tasks = dualpipev_tasks(2, 0, 4)
    fused = [t for t in tasks if isinstance(t, FusedTask)]
    assert len(tasks) == 16 and len(fused) == 3
    assert fused[0].split() == (fused[0].fwd, fused[0].bwd) and fused[0].fwd.kind == "F"
    with pytest.raises(ValueError, match="mpmd_idx"):
        dualpipev_tasks(2, 2, 4)

    def f(x):
        a = spx.sxstage_region("vision")(jnp.tanh)(x)
        return spx.sxstage_region("text")(jnp.sin)(a).sum()

    assert [s.name for s in stage_region_specs(jax.make_jaxpr(f)(jnp.ones(3)))] == ["vision", "text"]
    assert stage_region_specs(jax.make_jaxpr(jnp.sin)(1.0)) == []
    from spectrax_eager import runtime
    from spectrax_eager.runtime.mpmd.markers import stage_region_specs as at_the_seeds_path

    assert at_the_seeds_path is stage_region_specs and callable(runtime.sxstage_iter)  # the subpackage
    assert runtime.MpMdMesh is MpMdMesh  # does not hide the names taken from the runtime
