"""Every bad input gets a clear error, of a `ValueError` type, before any device work.

Each test checks the error type and the message: what was received, the rule,
and the way out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from mpmd_cases import make_schedule, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S


@pytest.fixture(scope="module")
def mesh2():
    return pipeline_mesh(2)


@pytest.fixture(scope="module")
def mesh4():
    return pipeline_mesh(4)


def _params():
    return {"w1": jnp.ones((4, 4)) * 0.1, "w2": jnp.ones((4, 3)) * 0.2}


def _batch(size=8):
    return np.ones((size, 4), np.float32)


def two_stage_loss(p, x):
    h = jnp.tanh(x @ p["w1"])
    h = mp.sxstage_iter(h)
    return jnp.mean((h @ p["w2"]) ** 2)


def _assert_no_device_work(step):
    assert step.compiler.cache == {}, "the error must come before anything is compiled"


def test_error_types_are_value_errors():
    for err in (mp.MpmdError, mp.StageSplitError, mp.MeshError, mp.TraceContextError):
        assert issubclass(err, ValueError)
    for err in (mp.StageSplitError, mp.MeshError, mp.TraceContextError):
        assert issubclass(err, mp.MpmdError)


# --- the traced function does not fit the pipeline ----------------------------------------


def test_marker_count_must_match_ranks_times_virtual_stages(mesh4):
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh4, schedule=S.Std1F1B(microbatches=4))
    with pytest.raises(
        mp.StageSplitError, match=r"found 1 stage marker\(s\).*2 stage\(s\).*need 4 stages.*3 markers"
    ):
        step(_params(), _batch())
    _assert_no_device_work(step)


def test_marker_count_counts_virtual_stages(mesh2):
    step = mp.sxvalue_and_grad(
        two_stage_loss, mesh=mesh2, schedule=S.InterleavedH1(microbatches=4, virtual_stages=2)
    )
    with pytest.raises(mp.StageSplitError, match=r"need 4 stages \(pipeline ranks x virtual stages\)"):
        step(_params(), _batch())


def test_declared_stage_must_match_marker_position(mesh2):
    def loss(p, x):
        h = mp.sxstage_iter(x @ p["w1"], stage=5)
        return jnp.mean(h @ p["w2"])

    step = mp.sxvalue_and_grad(loss, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    message = r"sxstage_iter\(stage=5\) is the marker that ends stage 0.*pass stage=0"
    with pytest.raises(mp.StageSplitError, match=message):
        step(_params(), _batch())


def test_marker_inside_a_loop_body_is_rejected(mesh2):
    def loss(p, x):
        def body(h, _):
            return mp.sxstage_iter(jnp.tanh(h @ p["w1"])), None

        h, _ = jax.lax.scan(body, x, None, length=1)
        return jnp.mean(h @ p["w2"])

    step = mp.sxvalue_and_grad(loss, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    with pytest.raises(
        mp.StageSplitError, match=r"sxstage_iter found inside a `scan` body.*Move the marker out"
    ):
        step(_params(), _batch())


def test_loss_must_be_computed_in_the_last_stage(mesh4):
    def loss(p, x):
        a = mp.sxstage_iter(x @ p["w1"])
        early = jnp.mean(a)  # stage 1 of 4
        b = mp.sxstage_iter(a)
        mp.sxstage_iter(b)
        return early

    step = mp.sxvalue_and_grad(loss, mesh=mesh4, schedule=S.Std1F1B(microbatches=4))
    with pytest.raises(
        mp.StageSplitError, match=r"must be computed in the last stage; it is computed in stage 1"
    ):
        step(_params(), _batch())
    _assert_no_device_work(step)


@pytest.mark.parametrize(
    "loss,received",
    [
        (lambda p, x: mp.sxstage_iter(x @ p["w1"]) @ p["w2"], r"f(loat)?32\[2,3\]"),
        (lambda p, x: jnp.sum(mp.sxstage_iter(x @ p["w1"]) @ p["w2"]).astype(jnp.int32), r"i(nt)?32\[\]"),
    ],
    ids=["vector", "integer"],
)
def test_loss_must_be_a_float_scalar(mesh2, loss, received):
    step = mp.sxvalue_and_grad(loss, mesh=mesh2, schedule=S.GPipe(microbatches=4))
    with pytest.raises(mp.MpmdError, match=r"the loss must be a floating-point scalar, got " + received):
        step(_params(), _batch())


def test_has_aux_needs_a_pair(mesh2):
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2, schedule=S.GPipe(microbatches=2), has_aux=True)
    with pytest.raises(mp.MpmdError, match=r"has_aux=True: the function must return a pair \(loss, aux\)"):
        step(_params(), _batch())


# --- arguments ----------------------------------------------------------------------------


def test_batch_must_divide_into_microbatches(mesh2):
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2, schedule=S.GPipe(microbatches=4))
    with pytest.raises(
        mp.MpmdError,
        match=r"batch size 6 \(leading axis of argument 1.*\) is not divisible by schedule\.microbatches=4.*multiple of 4",
    ):
        step(_params(), _batch(6))
    _assert_no_device_work(step)


def test_scalar_batch_leaf_has_no_axis_to_split(mesh2):
    def loss(p, x, scale):
        return two_stage_loss(p, x) * scale

    step = mp.sxvalue_and_grad(loss, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    with pytest.raises(
        mp.MpmdError, match=r"argument 2 \('scale'\) is a batch argument but has shape \(\).*batch_argnums="
    ):
        step(_params(), _batch(), np.float32(2.0))


def test_differentiated_leaves_must_be_floating_point(mesh2):
    def loss(p, x):
        return two_stage_loss(p, x) + 0.0 * p["count"]

    step = mp.sxvalue_and_grad(loss, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    with pytest.raises(mp.MpmdError, match=r"dtype int32; gradients need floating-point parameters.*argnums"):
        step({**_params(), "count": jnp.int32(3)}, _batch())


def test_argnums_must_name_an_argument(mesh2):
    step = mp.sxvalue_and_grad(two_stage_loss, argnums=3, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    with pytest.raises(mp.MpmdError, match=r"argnums=\(3,\), but the call has 2 positional argument\(s\)"):
        step(_params(), _batch())


def test_stage_sharding_leaves_must_be_partition_specs():
    with pytest.raises(TypeError, match=r"sharding leaves must be PartitionSpec or None, got str"):
        mp.sxstage_iter({"a": jnp.ones(2)}, sharding={"a": "fsdp"})


def test_sxjit_static_argnums_must_exist_and_be_hashable(mesh2):
    f = mp.sxjit(lambda x, k: mp.sxstage_iter(x * 2) + 1, mesh=mesh2, static_argnums=(1, 2))
    with pytest.raises(
        mp.MpmdError, match=r"static_argnums=\(1, 2\), but the call has 2 positional argument\(s\)"
    ):
        f(jnp.ones(2), 3)
    g = mp.sxjit(lambda x, k: mp.sxstage_iter(x * len(k)) + 1, mesh=mesh2, static_argnums=1)
    with pytest.raises(mp.MpmdError, match=r"static arguments must be hashable"):
        g(jnp.ones(2), [1, 2])


# --- schedule and mesh ----------------------------------------------------------------------


def test_schedule_is_required_without_regions(mesh2):
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2)
    with pytest.raises(mp.MpmdError, match=r"schedule= may be omitted only when .*opens no region"):
        step({"w1": jnp.ones((4, 4)), "w2": jnp.ones((4, 1))}, jnp.ones((8, 4)))
    _assert_no_device_work(step)


def test_schedule_must_be_a_schedule_object(mesh2):
    with pytest.raises(mp.MpmdError, match=r"schedule must be a schedule object .*got 'gpipe'"):
        mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2, schedule="gpipe")


def test_schedule_table_must_be_valid_for_the_rank_count(mesh2):
    # checked at the first call, once the trace shows the function has no regions (a region
    # pipeline checks each region's schedule on the region's own ranks)
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2, schedule=S.DualPipeV(microbatches=2))
    with pytest.raises(
        mp.MpmdError, match=r"not valid for 2 pipeline ranks: DualPipeV: needs microbatches >= 2 \* n"
    ):
        step(_params(), _batch())
    _assert_no_device_work(step)
    forward = mp.sxjit(two_stage_loss, mesh=pipeline_mesh(4), schedule=make_schedule("KimiK2", 2, 2))
    with pytest.raises(mp.MpmdError, match=r"not valid for 4 pipeline ranks: .*microbatches >= n"):
        forward(_params(), _batch())
    _assert_no_device_work(forward)


def test_mesh_must_have_a_pipeline_axis():
    plain = mp.create_mesh((1, 1, -1, 1, 1, 1))
    message = r"the mesh has no pipeline axis; build it with create_mesh\(\.\.\., mpmd_axis='pp'\)"
    with pytest.raises(mp.MpmdError, match=message):
        mp.sxvalue_and_grad(two_stage_loss, mesh=plain, schedule=S.GPipe(microbatches=2))
    with pytest.raises(mp.MpmdError, match=r"sxjit: the mesh has no pipeline axis"):
        mp.sxjit(two_stage_loss, mesh=plain)


def test_jax_mesh_without_the_named_axis():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("dp", "tp"))
    with pytest.raises(mp.MeshError, match=r"axis 'pp' not in the mesh axes \('dp', 'tp'\)"):
        mp.sxvalue_and_grad(two_stage_loss, mesh=mesh, schedule=S.GPipe(microbatches=2))
    with pytest.raises(mp.MeshError, match=r"expected an MpmdMesh or jax\.sharding\.Mesh, got str"):
        mp.sxjit(two_stage_loss, mesh="pp")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(axis_dims=(2, 4)), r"axis_dims has 2 entries but axis_names has 6"),
        (dict(axis_dims=(-1, 1, -1, 1, 1, 1)), r"must be positive, with at most one -1"),
        (dict(axis_dims=(2, 0, -1, 1, 1, 1)), r"must be positive, with at most one -1"),
        (dict(axis_dims=(3, 1, -1, 1, 1, 1)), r"8 devices are not divisible by the fixed axes' product 3"),
        (dict(axis_dims=(4, 1, 4, 1, 1, 1)), r"need 16 devices but only 8 are available"),
        (
            dict(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="stage"),
            r"mpmd_axis 'stage' is not one of axis_names",
        ),
    ],
    ids=["names", "two-free", "zero", "indivisible", "too-many", "axis"],
)
def test_create_mesh_errors(kwargs, message):
    with pytest.raises(mp.MeshError, match=message):
        mp.create_mesh(**kwargs)


def test_submesh_rank_out_of_range(mesh2):
    with pytest.raises(mp.MeshError, match=r"submesh: rank must be in \[0, 2\), got 2"):
        mesh2.submesh(2)


# --- called inside another transformation ------------------------------------------------


def test_step_under_outer_jit_is_rejected(mesh2):
    step = mp.sxvalue_and_grad(two_stage_loss, mesh=mesh2, schedule=S.GPipe(microbatches=2))
    with pytest.raises(
        mp.TraceContextError, match=r"sxvalue_and_grad was called inside a JAX transformation"
    ):
        jax.jit(step)(_params(), _batch())
    with pytest.raises(mp.TraceContextError, match=r"cannot be traced into another program"):
        jax.grad(lambda p: step(p, _batch())[0])(_params())
    _assert_no_device_work(step)


def test_sxjit_under_outer_jit_is_rejected(mesh2):
    f = mp.sxjit(lambda x: mp.sxstage_iter(x * 2) + 1, mesh=mesh2)
    with pytest.raises(mp.TraceContextError, match=r"sxjit was called inside a JAX transformation"):
        jax.jit(f)(jnp.ones(3))
