"""Pipeline ranks of different sizes in a job of two processes (4 CPU devices each), each process
owning whole ranks: training equals the unsplit function on one device (`ranks_worker.py`); and
the layouts a value travels in between two ranks that cut it differently (`_comm.wire`)."""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from launching import launch
from ranks_worker import RANKS, STEPS, batch_of, loss, params_of, reference_step, tx

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks_worker.py")
RTOL = 1e-5


def _merged(out_dir, case: str) -> dict:
    """Both processes' shares of `case`: the loss and the optimizer's step count (scalars every
    process returns) are on both and equal, every other leaf on one."""
    files = sorted(glob.glob(os.path.join(out_dir, f"{case}_p*.npz")))
    assert len(files) == 2, files
    merged: dict = {}
    for f in files:
        with np.load(f) as z:
            for k in z.files:
                if k in merged and (k in ("loss", "losses") or z[k].ndim == 0):
                    np.testing.assert_array_equal(z[k], merged[k])
                    continue
                assert k not in merged, f"{case}: {k} returned by both processes"
                merged[k] = z[k]
    return merged


def _check(merged: dict, prefix: str, trees) -> None:
    leaves = jax.tree.leaves(trees)
    assert sorted(k for k in merged if k.startswith(prefix)) == sorted(
        f"{prefix}{k}" for k in range(len(leaves))
    )
    for k, want in enumerate(leaves):
        np.testing.assert_allclose(merged[f"{prefix}{k}"], want, rtol=RTOL, atol=1e-6)


@pytest.mark.slow  # two launched processes compiling their ranks: about a minute on 2 shared cores
def test_ranks_of_different_sizes_across_processes(tmp_path):
    """Std1F1B on ranks of 1, 1, 2 | 4 devices and of (fsdp=2 x tp=2) | (fsdp=4), with the
    default FSDP x TP rules inside each rank, and two one-plan steps (clipping, AdamW) on the
    first, through each transport: loss, gradients, parameters and optimizer state equal the
    unsplit computation on one device."""
    job = launch(WORKER, "ranks", tmp_path, nproc=2, devices=4, limit=400, timeout=60)
    grads = {
        name: jax.jit(jax.value_and_grad(loss))(params_of(len(r)), *batch_of(0)) for name, r in RANKS.items()
    }
    params = params_of(4)
    state, losses = tx().init(params), []
    for k in range(STEPS):
        value, params, state = jax.jit(reference_step)(params, state, *batch_of(k))
        losses.append(float(value))
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in ("transfer", "ppermute"):
        for name, (value, g) in grads.items():
            merged = _merged(tmp_path, f"grad-{name}-{transport}")
            np.testing.assert_allclose(merged["loss"], value, rtol=RTOL)
            _check(merged, "g", g)
        merged = _merged(tmp_path, f"apply-1124-{transport}")
        np.testing.assert_allclose(merged["losses"], losses, rtol=RTOL)
        _check(merged, "x", (params, state))


def _sharding(devices, axes: dict, spec):
    grid = np.asarray(devices, dtype=object).reshape(tuple(axes.values()))
    return NamedSharding(Mesh(grid, tuple(axes)), spec)


WIRE_CASES = {  # id -> (sender axes, spec, receiver axes, spec): sender on devices 0.., receiver 4..
    "2-split to 4-split": ({"fsdp": 2}, P("fsdp"), {"fsdp": 4}, P("fsdp")),
    "4-split to 2-split": ({"fsdp": 4}, P("fsdp"), {"fsdp": 2}, P("fsdp")),
    "2x2 to 4, other axis": ({"fsdp": 2, "tp": 2}, P("fsdp", "tp"), {"fsdp": 4}, P(None, "fsdp")),
    "1 to 4-split": ({"fsdp": 1}, P(), {"fsdp": 4}, P("fsdp")),
    "4 replicated to 1": ({"fsdp": 4}, P(), {"fsdp": 1}, P()),
    "3-split to 2x2 replicated": ({"fsdp": 3}, P("fsdp"), {"fsdp": 2, "tp": 2}, P("fsdp")),
}


@pytest.mark.parametrize("case", list(WIRE_CASES))
def test_wire_layout_moves_shard_to_shard(case):
    """The layouts a cross-process move travels in cut the value alike on both sides, on as many
    devices as the smaller side has; resharding into the sender's one, moving the i-th shard to
    the receiver's i-th device (what the transports do) and resharding into the receiver's layout
    gives the value, and a value split on both sides is never whole on one device on the way."""
    from spectrax_mpmd._comm.reshard import reshard
    from spectrax_mpmd._comm.wire import wire

    sender_axes, sender_spec, receiver_axes, receiver_spec = WIRE_CASES[case]
    devices = jax.devices()
    n_src, n_dst = int(np.prod(list(sender_axes.values()))), int(np.prod(list(receiver_axes.values())))
    src = _sharding(devices[:n_src], sender_axes, sender_spec)
    dst = _sharding(devices[4 : 4 + n_dst], receiver_axes, receiver_spec)
    x = jax.device_put(np.arange(12 * 8, dtype=np.float32).reshape(12, 8), src)
    on_sender, on_receiver = wire(src, dst)
    assert len(on_sender.device_set) == len(on_receiver.device_set) == min(n_src, n_dst)
    assert on_sender.device_set <= src.device_set and on_receiver.device_set <= dst.device_set
    shape = x.shape
    sent = reshard(x, on_sender)
    indices = [index for _, index in on_sender.devices_indices_map(shape).items()]
    assert indices == [index for _, index in on_receiver.devices_indices_map(shape).items()]
    moved = [
        jax.device_put(sent.addressable_data(k), d)
        for k, d in enumerate(on_receiver.addressable_devices_indices_map(shape))
    ]
    arrived = jax.make_array_from_single_device_arrays(shape, on_receiver, moved)
    np.testing.assert_array_equal(reshard(arrived, dst), x)
    if not (src.is_fully_replicated or dst.is_fully_replicated):
        assert on_sender.shard_shape(shape) != shape
