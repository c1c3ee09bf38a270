"""Checkpoints: written rank by rank, restored into another pipeline layout, resumed exactly.

A tied-embedding core LM (8 blocks) trains 3 AdamW steps on 4 ranks (Std1F1B)
and is saved; the checkpoint restores into 2 ranks (ZeroBubbleH1) and into
one device, parameters and optimizer state bitwise equal, and 3 more steps
there equal 3 more steps of the uninterrupted run. The arrays handed to
orbax are checked to sit on their owner rank's devices.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from jax.tree_util import keystr, tree_flatten_with_path
from mpmd_cases import lm_batch, pipeline_mesh, tiny_lm

import spectrax_mpmd as mp
from spectrax_core import schedules
from spectrax_core.losses import softmax_cross_entropy

pytest.importorskip("orbax.checkpoint")

LAYERS, SAVED_AT, MORE = 8, 3, 3


def _abstract(n_stages: int = 1, **kw):
    """The LM's shapes without its values (nothing allocated), cut into `n_stages`."""
    kw = {"n_layers": LAYERS, "tie_embeddings": True, **kw}
    return jax.eval_shape(lambda: mp.stage_blocks(tiny_lm(jax.random.key(0), **kw), n_stages))


def _opt():
    return mp.StagedOptimizer(optax.adamw(1e-2, weight_decay=0.1), max_grad_norm=1.0)


def _train(step, opt, params, state, batches):
    losses = []
    for tokens, targets in batches:
        loss, grads = step(params, tokens, targets)
        if state is None:
            state = opt.init(params, grads)
        params, state = opt.update(grads, state, params)
        losses.append(float(loss))
    return params, state, losses


def _unstaged(named: dict) -> dict:
    """`{path: array}` with stage parts joined in part order: `.blocks.parts[k].layers.x` -> `.blocks.layers.x`."""
    joined: dict = {}
    for path, x in named.items():
        part = re.search(r"\.parts\[(\d+)\]", path)
        key = re.sub(r"\.parts\[\d+\]", "", path)
        joined.setdefault(key, []).append((int(part[1]) if part else 0, np.asarray(x)))
    return {k: np.concatenate([x for _, x in sorted(v, key=lambda t: t[0])]) for k, v in joined.items()}


def _params_by_path(params) -> dict:
    return _unstaged({keystr(p): x for p, x in tree_flatten_with_path(params)[0]})


def _adam_by_path(params, state) -> dict:
    """AdamW's `mu`, `nu` per parameter path and every group's step count, read by hand."""
    paths = [keystr(p) for p, _ in tree_flatten_with_path(params)[0]]
    named, counts = {}, set()
    for idx, st in zip(state.groups, state.states):
        adam = st[0]
        counts.add(int(adam.count))
        for i, k in enumerate(idx):
            named[("mu", paths[k])] = adam.mu[i]
            named[("nu", paths[k])] = adam.nu[i]
    by_field = {}
    for field in ("mu", "nu"):
        part = _unstaged({p: x for (f, p), x in named.items() if f == field})
        by_field.update({(field, p): x for p, x in part.items()})
    return by_field, counts


def _assert_bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted 4-rank run: saved after 3 steps, then 3 more steps as the reference."""
    directory = tmp_path_factory.mktemp("ckpt")
    lm = tiny_lm(jax.random.key(0), n_layers=LAYERS, tie_embeddings=True)
    batches = [lm_batch(k, 8) for k in jax.random.split(jax.random.key(1), SAVED_AT + MORE)]
    step = mp.runner(
        mesh=pipeline_mesh(4), loss_fn=softmax_cross_entropy, schedule=schedules.Std1F1B(microbatches=4)
    )
    opt = _opt()
    params, state, _ = _train(step, opt, mp.stage_blocks(lm, 4), None, batches[:SAVED_AT])
    handed = []
    import orbax.checkpoint as ocp

    original = ocp.args.PyTreeSave

    def recording(item, *args, **kw):
        handed.append(item)
        return original(item, *args, **kw)

    ocp.args.PyTreeSave = recording
    try:
        mp.save_checkpoint(directory, SAVED_AT, params=params, opt_state=state, extra={"data": SAVED_AT})
    finally:
        ocp.args.PyTreeSave = original
    at_save = (_params_by_path(params), *_adam_by_path(params, state))
    final, _, losses = _train(step, opt, params, state, batches[SAVED_AT:])
    return dict(
        directory=directory,
        lm=lm,
        batches=batches,
        params=params,
        handed=handed,
        at_save=at_save,
        final=_params_by_path(final),
        losses=losses,
        mesh=pipeline_mesh(4),
    )


def _resume(saved, step, like):
    """Restore the saved step onto `step`'s owners, check it bitwise, train the remaining steps."""
    opt = _opt()
    tokens, targets = saved["batches"][SAVED_AT]
    shardings = mp.owner_shardings(step, like, tokens, targets)
    restored = mp.restore_checkpoint(saved["directory"], like=like, shardings=shardings, optimizer=opt)
    assert restored.step == SAVED_AT and restored.extra == {"data": SAVED_AT}
    _, grads = step(restored.params, tokens, targets)  # owner_shardings is where gradients come back
    for x, g, sh in zip(*map(jax.tree.leaves, (restored.params, grads, shardings))):
        assert x.sharding.device_set == g.sharding.device_set == sh.device_set
    params, mu_nu, counts = saved["at_save"]
    _assert_bitwise(_params_by_path(restored.params), params)
    got_mu_nu, got_counts = _adam_by_path(restored.params, restored.opt_state)
    _assert_bitwise(got_mu_nu, mu_nu)
    assert got_counts == counts == {SAVED_AT}
    final, _, losses = _train(step, opt, restored.params, restored.opt_state, saved["batches"][SAVED_AT:])
    np.testing.assert_allclose(losses, saved["losses"], rtol=1e-6)
    got = _params_by_path(final)
    for k, ref in saved["final"].items():
        np.testing.assert_allclose(got[k], ref, rtol=1e-6, atol=1e-7, err_msg=k)


def test_restore_into_two_ranks_zero_bubble_continues_exactly(saved):
    step = mp.runner(
        mesh=pipeline_mesh(2), loss_fn=softmax_cross_entropy, schedule=schedules.ZeroBubbleH1(microbatches=4)
    )
    _resume(saved, step, _abstract(2))


def test_restore_onto_one_device_continues_exactly(saved):
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), devices=jax.devices()[:1])
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, microbatches=4)
    _resume(saved, step, _abstract(1))


@pytest.mark.parametrize("ranks,v", [(8, 1), (2, 2)], ids=["pp8", "pp2-virtual2"])
def test_restore_into_other_layouts_places_each_part_on_its_rank(saved, ranks, v):
    """8 ranks, or 2 ranks x 2 virtual stages (interleaved): part k on the rank that runs stage k."""
    like = _abstract(ranks * v)
    schedule = (
        schedules.InterleavedH1(microbatches=4, virtual_stages=v)
        if v > 1
        else schedules.Std1F1B(microbatches=4)
    )
    devices = jax.devices()

    def place(path, _):
        text = keystr(path)
        found = re.search(r"\.parts\[(\d+)\]", text)
        stage = int(found[1]) if found else 0 if "embed" in text else ranks * v - 1
        return jax.sharding.SingleDeviceSharding(devices[schedule.rank_of(stage, ranks)])

    shardings = jax.tree_util.tree_map_with_path(place, like)
    restored = mp.restore_checkpoint(saved["directory"], like=like, shardings=shardings, optimizer=_opt())
    _assert_bitwise(_params_by_path(restored.params), saved["at_save"][0])
    _assert_bitwise(_adam_by_path(restored.params, restored.opt_state)[0], saved["at_save"][1])
    for x, sh in zip(jax.tree.leaves(restored.params), jax.tree.leaves(shardings)):
        assert x.sharding.device_set == sh.device_set
    assert len(restored.opt_state.groups) == ranks


def test_each_array_is_handed_to_orbax_on_its_owner_rank(saved):
    """Block layer i lives on rank i // 2, the tied table on rank 0, the final norm on rank 3."""
    params_arrays, opt_arrays = saved["handed"]
    mesh = saved["mesh"]
    rank_devices = [set(mesh.submesh(r).devices.flat) for r in range(4)]
    assert all(len(d) == 2 for d in rank_devices)  # each rank is 2 devices (fsdp), replicated

    def owner(name: str) -> int:
        layer = re.search(r"blocks\.layers.*\[(\d+)\]$", name)
        if layer:
            return int(layer[1]) // 2
        return 0 if "embed" in name else 3

    for name, x in params_arrays.items():
        assert x.sharding.device_set == rank_devices[owner(name)], (name, x.sharding)
    for name, x in opt_arrays.items():  # per parameter "<state path>/<param>", shared counts on group 0
        param = name.split("/", 1)[1] if "/" in name else "embed"
        assert x.sharding.device_set == rank_devices[owner(param)], (name, x.sharding)
    assert len(params_arrays) == 2 + LAYERS * 9  # table, final norm, 9 leaves per block
    assert sum(x.nbytes for x in params_arrays.values()) == sum(
        x.nbytes for x in jax.tree.leaves(saved["params"])
    )
    shared = [x for name, x in opt_arrays.items() if "/" not in name]
    assert shared and all(x.shape == () for x in shared)  # step counts, from the first group only


def test_structure_mismatch_names_the_first_differing_leaf(saved):
    lm = _abstract(4)
    narrow = jax.ShapeDtypeStruct((2, 16, 8), np.float32)
    bad = eqx.tree_at(lambda m: m.blocks.parts[0].layers.mlp.up.weight, lm, narrow)
    match = r"\.blocks\.parts\[0\]\.layers\.mlp\.up\.weight.*float32\[16, 8\].*float32\[16, 32\]"
    with pytest.raises(mp.CheckpointError, match=match):
        mp.restore_checkpoint(saved["directory"], like=bad)
    with pytest.raises(mp.CheckpointError, match=r"\.head\.weight.*is not in the checkpoint"):
        mp.restore_checkpoint(saved["directory"], like=_abstract(tie_embeddings=False))
    with pytest.raises(
        mp.CheckpointError, match=r"blocks\.layers\.norm1\.scale\[6\].*no place in the target"
    ):
        mp.restore_checkpoint(saved["directory"], like=_abstract(n_layers=LAYERS - 2))
    with pytest.raises(mp.CheckpointError, match="optimizer=<the StagedOptimizer>"):
        mp.restore_checkpoint(saved["directory"], like=saved["lm"], opt_like={"x": np.zeros(2)})


def test_missing_directory_and_step_say_what_exists(saved, tmp_path):
    with pytest.raises(mp.CheckpointError, match="does not exist"):
        mp.restore_checkpoint(tmp_path / "nowhere", like=saved["lm"])
    assert not (tmp_path / "nowhere").exists()
    with pytest.raises(mp.CheckpointError, match=rf"step 7 is not in .*holds steps \[{SAVED_AT}\]"):
        mp.restore_checkpoint(saved["directory"], 7, like=saved["lm"])
    with pytest.raises(mp.CheckpointError, match="JSON"):
        mp.save_checkpoint(tmp_path / "x", 1, params={"w": np.zeros(2)}, extra={"bad": object()})


def test_manager_keeps_the_newest_and_saves_in_the_background(tmp_path):
    tree = {"w": jax.device_put(np.arange(6.0, dtype=np.float32).reshape(2, 3), jax.devices()[3])}
    with mp.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for k in range(1, 5):
            assert manager.save(k, params=jax.tree.map(lambda x: x * k, tree), extra={"k": k})
        manager.wait_until_finished()
        assert manager.all_steps() == [3, 4] and manager.latest_step() == 4
        with pytest.raises(mp.CheckpointError, match=r"step 4 already exists.*manager\.delete\(4\)"):
            manager.save(4, params=tree)
        like = {
            "w": jax.ShapeDtypeStruct(
                (2, 3), np.float32, sharding=NamedSharding(pipeline_mesh(4).submesh(2), PartitionSpec())
            )
        }
        got = manager.restore(3, like=like)
    assert got.extra == {"k": 3} and got.opt_state is None
    manager = mp.CheckpointManager(tmp_path)
    manager.delete(4)
    assert manager.all_steps() == [3]
    manager.close()
    assert got.params["w"].sharding.device_set == set(pipeline_mesh(4).submesh(2).devices.flat)
    np.testing.assert_array_equal(got.params["w"], np.arange(6.0).reshape(2, 3) * 3)


KILLED_SAVE = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    import jax, jax.numpy as jnp
    import spectrax_mpmd as mp
    root = pathlib.Path(sys.argv[1])
    manager = mp.CheckpointManager(root)
    manager.save(1, params={"w": jnp.ones((4,), jnp.float32)})
    manager.wait_until_finished()
    manager.save(2, params={"w": jnp.zeros((1 << 24,), jnp.float32)})  # 64 MB, written in the background
    deadline = time.monotonic() + 30
    # kill once the background write has started (its temporary folder exists), before it commits
    while not any(p.name.startswith("2.") for p in root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_save_killed_midway_is_never_read(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-c", KILLED_SAVE, str(tmp_path)]
    result = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)
    assert result.returncode == -9, result.stderr[-3000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "1" in names and "2" not in names
    assert any(n.startswith("2.") and "tmp" in n for n in names), names  # the uncommitted step 2
    manager = mp.CheckpointManager(tmp_path, create=False)
    assert manager.all_steps() == [1] and manager.latest_step() == 1
    like = {"w": jax.ShapeDtypeStruct((4,), np.float32)}
    restored = manager.restore(like=like)
    assert restored.step == 1 and np.array_equal(restored.params["w"], np.ones(4))
    with pytest.raises(mp.CheckpointError, match=r"step 2 is not in .*holds steps \[1\]"):
        manager.restore(2, like=like)
    manager.close()


def test_owner_shardings_refuses_a_forward_step(saved):
    step = mp.runner(mesh=pipeline_mesh(2), mode="forward", schedule=schedules.GPipe(microbatches=2))
    with pytest.raises(mp.CheckpointError, match="forward"):
        mp.owner_shardings(step, _abstract(2), saved["batches"][0][0])


def test_missing_orbax_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(mp.CheckpointError, match=r"spectrax-mpmd\[checkpoint\]"):
        mp.CheckpointManager(tmp_path)
