"""The accelerator checks, run in a process of their own on JAX's default platform (the suite pins
its own process to the CPU): `python accelerator_worker.py OUT.json CHECKPOINT_DIR [--cpu-too]`.

Writes `{"platform", "device_kind", "checks": {name: {...} or {"error": text}}}`; on a machine
whose JAX sees only CPU devices, `{"platform": "cpu"}` and nothing else, unless `--cpu-too` runs the
checks there as well (so that the suite proves them where no accelerator is). Every check runs on
one rank (one device) under `jax.default_matmul_precision("highest")`, and reports figures
(errors against one `jax.jit` in units of the exactness tolerance, token agreement, issue costs)
for `test_mpmd_accelerator.py` to hold to its tolerances."""

from __future__ import annotations

import json
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM, greedy_decode

M = 4  # microbatches
RTOL, ATOL = 1e-5, 1e-6  # the exactness contract in fp32 (docs/reference.md)


def mlp_loss(params, batch, cut: bool):
    """A 4-layer tanh MLP's squared error; `cut` puts a stage boundary after its second layer."""
    x, y = batch
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if cut and k == 1:
            x = mp.sxstage_iter(x)
    return jnp.mean((x - y) ** 2)


def error(got, want) -> float:
    """The largest `|got - want| / (ATOL + RTOL |want|)` over every element of every leaf: at most 1
    where `got` equals `want` to the contract's tolerance."""
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    pairs = [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in leaves]
    return max(float(np.max(np.abs(a - b) / (ATOL + RTOL * np.abs(b)))) for a, b in pairs)


def one_rank(schedule, device) -> dict:
    """The pipelined loss and gradients of `schedule` on one rank against one `jax.jit` of the unsplit
    function on the same device, then five training steps of the whole step (the update inside)."""
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    keys = jax.random.split(jax.random.key(0), 6)
    params = [jax.device_put(jax.random.normal(k, (64, 64)) / 8, device) for k in keys[:4]]
    batch = tuple(jax.device_put(jax.random.normal(k, (32, 64)), device) for k in keys[4:])
    cut = schedule.virtual_stages > 1

    def loss(p, b):
        return mlp_loss(p, b, cut)

    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule)
    got = step(params, batch)
    want = jax.jit(jax.value_and_grad(lambda p, b: mlp_loss(p, b, False)))(params, batch)
    tx = optax.adam(1e-2)
    train = mp.sxvalue_and_grad_and_apply(loss, tx, mesh=mesh, schedule=schedule)
    state, losses = tx.init(params), []
    for _ in range(5):
        value, params, state = train(params, state, batch)
        losses.append(float(value))
    return {"loss_error": error(got[0], want[0]), "grad_error": error(got[1], want[1]), "losses": losses}


def lm_checks(device, directory: str) -> dict:
    """A byte LM cut into two stages on one rank (InterleavedH1, v=2), trained through `mp.runner` as
    the main job trains: its `generate` against the unsplit model's greedy decode, a checkpoint
    written and read back onto the same rank, and the host-cost table of one step."""
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=[device])
    schedule = S.InterleavedH1(microbatches=M, virtual_stages=2)
    tx = optax.adamw(3e-3)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule, tx=tx)

    def init(key):
        lm = TransformerLM.init(key, vocab_size=256, d_model=64, n_layers=4, n_heads=4, d_ff=256)
        return mp.stage_blocks(lm, 2)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 33)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params, state = mp.init_on_owners(step, init, jax.random.key(0), inputs, targets)
    losses = []
    for _ in range(5):
        loss, params, state = step.update(params, state, inputs, targets)
        losses.append(float(loss))
    prompt = jax.device_put(jnp.asarray(tokens[:1, :8]), device)
    sample = step.generate(params, prompt, 12)
    reference = greedy_decode(mp.unstage_blocks(mp.gather(params, device=device)), prompt, 12)
    manager = mp.CheckpointManager(directory, max_to_keep=1)
    manager.save(5, params=params, opt_state=state, force=True)
    manager.close()
    like, opt_like = mp.owner_layout(step, init, jax.random.key(0), inputs, targets)
    restored = mp.CheckpointManager(directory).restore(5, like=like, opt_like=opt_like)
    saved = jax.tree.leaves((params, state))
    read = jax.tree.leaves((restored.params, restored.opt_state))
    host = step.runner.update_step.profile(params, state, None, inputs, targets, rounds=3)
    return {
        "losses": losses,
        "decode_identical": bool(np.array_equal(np.asarray(sample), np.asarray(reference))),
        "restored_step": restored.step,
        "restored_identical": len(saved) == len(read)
        and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(saved, read)),
        "restored_on_rank": all(device in x.devices() for x in jax.tree.leaves(restored.params)),
        "host": host.as_dict(),
        "host_table": host.table(),
    }


def main(out: str, directory: str, *flags: str) -> None:
    device = jax.devices()[0]
    if device.platform == "cpu" and "--cpu-too" not in flags:
        result = {"platform": "cpu"}
    else:
        result = {"platform": device.platform, "device_kind": device.device_kind, "checks": {}}
        checks = {
            "Std1F1B": lambda: one_rank(S.Std1F1B(microbatches=M), device),
            "InterleavedH1": lambda: one_rank(S.InterleavedH1(microbatches=M, virtual_stages=2), device),
            "lm": lambda: lm_checks(device, directory),
        }
        for name, check in checks.items():
            try:
                with jax.default_matmul_precision("highest"):
                    result["checks"][name] = check()
            except Exception:  # reported, so that one failure does not hide the other checks'
                result["checks"][name] = {"error": traceback.format_exc()[-3000:]}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
