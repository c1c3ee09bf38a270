"""Meshes whose pipeline ranks own different numbers of devices: building them, and the errors."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd.errors import MeshError

UNEVEN = [{"fsdp": 1}, {"fsdp": 1}, {"fsdp": 2}, {"fsdp": 2, "tp": 2}]


def _devices(mesh) -> list:
    return list(np.asarray(mesh.devices).flat)


def test_ranks_take_consecutive_devices_with_their_own_axes():
    mesh = mp.create_rank_mesh(UNEVEN)
    assert mesh.mpmd_dim == 4 and mesh.rank_sizes == (1, 1, 2, 4) and not mesh.uniform
    assert mesh.rank_shapes == tuple(UNEVEN)
    assert [_devices(mesh.submesh(r)) for r in range(4)] == [
        jax.devices()[:1],
        jax.devices()[1:2],
        jax.devices()[2:4],
        jax.devices()[4:],
    ]
    assert mesh.submesh(3).axis_names == ("fsdp", "tp")
    assert mesh.axis_names == ("pp", "fsdp", "tp") and mesh.spmd_axis_names == ("fsdp", "tp")
    assert _devices(mesh) == jax.devices()
    assert {mesh.rank_of(d) for d in jax.devices()} == {None}  # a device is not placed
    assert [mesh.rank_of(jax.device_put(1.0, d)) for d in jax.devices()] == [0, 1, 2, 2, 3, 3, 3, 3]


def test_ranks_of_one_shape_give_the_rectangular_mesh():
    even = mp.create_rank_mesh([{"fsdp": 2, "tp": 1}] * 4)
    same = mp.mesh_of_ranks([even.submesh(r) for r in range(4)])
    ref = mp.create_mesh((4, 2, 1), ("pp", "fsdp", "tp"), mpmd_axis="pp")
    for mesh in (even, same):
        assert mesh.uniform and mesh.rank_sizes == (2, 2, 2, 2)
        assert mesh.jax_mesh.shape == ref.jax_mesh.shape
        assert _devices(mesh.jax_mesh) == _devices(ref.jax_mesh)


def test_the_rectangular_mesh_of_uneven_ranks_is_refused_clearly():
    mesh = mp.create_rank_mesh(UNEVEN)
    with pytest.raises(MeshError, match="no single rectangular jax mesh.*submesh"):
        mesh.jax_mesh
    with pytest.raises(MeshError, match="rectangular"):
        mesh.shape
    with pytest.raises(MeshError, match="rectangular"):
        with mesh:
            pass


def test_a_list_of_jax_meshes_is_a_mesh():
    d = np.asarray(jax.devices(), dtype=object)
    mesh = mp.mesh_of_ranks([Mesh(d[:2], ("dp",)), Mesh(d[2:8].reshape(2, 3), ("fsdp", "tp"))])
    assert mesh.rank_sizes == (2, 6) and mesh.submesh(1).shape == {"fsdp": 2, "tp": 3}


@pytest.mark.parametrize(
    "build, rule",
    [
        (lambda: mp.create_rank_mesh([{"fsdp": 2}, {"fsdp": 4}]), "add up to 6 devices but 8 are given"),
        (lambda: mp.create_rank_mesh([{"fsdp": 2}] * 4, devices=jax.devices()[:4]), "add up to 8"),
        (lambda: mp.create_rank_mesh([{"fsdp": 0}, {"fsdp": 8}]), r"rank_axes\[0\] must be .*positive"),
        (lambda: mp.create_rank_mesh([{"pp": 4}, {"fsdp": 4}]), "names the pipeline axis"),
        (lambda: mp.create_rank_mesh([{"fsdp": 4}, {"fsdp": 4}], devices=jax.devices()[:4] * 2), "disjoint"),
        (
            lambda: mp.mesh_of_ranks([Mesh(np.asarray(jax.devices()[:2]), ("x",))] * 2),
            r"in meshes\[0\] and meshes\[1\]",
        ),
        (lambda: mp.mesh_of_ranks([jax.devices()]), "jax.sharding.Mesh"),
    ],
)
def test_bad_ranks_are_refused_with_the_rule(build, rule):
    with pytest.raises(MeshError, match=rule):
        build()


def _loss(params, x):
    h = jnp.tanh(x @ params[0])
    h = mp.sxstage_iter(h, sharding=P("tp"))
    return jnp.mean(jnp.tanh(h @ params[1]) ** 2)


def test_a_boundary_sharding_naming_an_axis_a_rank_lacks_is_refused():
    mesh = mp.create_rank_mesh([{"fsdp": 2}, {"fsdp": 3, "tp": 2}])
    step = mp.sxvalue_and_grad(_loss, mesh=mesh, schedule=S.Std1F1B(2))
    params, x = [jnp.ones((4, 4)), jnp.ones((4, 4))], jnp.ones((12, 4))
    with pytest.raises(MeshError, match=r"sharded as P\('tp',\).*\['tp'\].*rank 0.*size 1 is fine"):
        step(params, x)


def test_copies_of_a_stage_on_ranks_of_different_shapes_are_refused():
    """DualPipe runs every model stage on two ranks; those need one shape."""
    mesh = mp.create_rank_mesh(UNEVEN)

    def loss(params, x):
        for k, w in enumerate(params):
            x = jnp.tanh(x @ w)
            if k < 3:
                x = mp.sxstage_iter(x)
        return jnp.mean(x**2)

    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.DualPipe(8))
    with pytest.raises(MeshError, match=r"runs on rank \d .* and on rank \d .*equal submeshes"):
        step([jnp.ones((4, 4))] * 4, jnp.ones((8, 4)))


def test_rank_processes_takes_ranks_of_different_shapes():
    """Ranks of different shapes are placed like any others (the job over processes runs them:
    test_mpmd_ranks_multihost)."""
    from spectrax_mpmd._plan.localize import rank_processes

    assert rank_processes(mp.create_mesh((2, 4), ("pp", "fsdp"), mpmd_axis="pp")) == (0, 0)
    assert rank_processes(mp.create_rank_mesh(UNEVEN)) == (0,) * len(UNEVEN)


def test_reshard_moves_every_layout_between_meshes_of_other_sizes():
    """Every spec on meshes of 1, 2, 4 (2 x 2) and 6 (3 x 2) devices to every other mesh's: the
    values and the target sharding, whichever way the pieces tile."""
    from spectrax_mpmd._comm.reshard import reshard

    d = np.asarray(jax.devices(), dtype=object)
    meshes = [
        (Mesh(d[:1], ("a",)), [P(), P("a")]),
        (Mesh(d[1:3], ("a",)), [P(), P("a"), P(None, "a")]),
        (Mesh(d[4:8].reshape(2, 2), ("a", "b")), [P(), P("a", "b"), P("b", "a"), P(None, ("a", "b"))]),
        (Mesh(d[2:8].reshape(3, 2), ("a", "b")), [P(), P("a", "b"), P(("a", "b")), P("b", "a")]),
    ]
    want = np.arange(144, dtype=np.float32).reshape(12, 12)
    for (src, src_specs), (dst, dst_specs) in itertools.permutations(meshes, 2):
        for a, b in itertools.product(src_specs, dst_specs):
            moved = reshard(jax.device_put(want, NamedSharding(src, a)), NamedSharding(dst, b))
            assert moved.sharding == NamedSharding(dst, b)
            np.testing.assert_array_equal(np.asarray(moved), want, err_msg=f"{a} -> {b}")
