"""The script the fault tests run: two processes of one job that disagree about what to run.

    python -m spectrax_mpmd.launch --nproc 2 faults_worker.py MODE OUT

Each process writes `OUT/<mode>_p<process>.json`: per case, the error it raised
(`"DistributedError: ..."`) or the losses it computed with the unsplit
`jax.value_and_grad` reference of its own function. Both processes catch the
errors the checks raise (they raise them together, so the job goes on to the
next case); a transfer error ends the process, so the modes that provoke one
write their file before.

MODE:

* `built`: the processes build different steps: stage markers in other places,
  another schedule, another microbatch count; another schedule again, found by
  `step.prepare` before any call; then the same step, prepared (on shapes only), then run.
* `inputs` (numpy batches, the default check): the same batch for two calls,
  then other values on process 1; both run batches of 8 and 16 rows, then
  process 1 passes 16 where process 0 passes 8; then the same batch again.
* `waiting` (`SPECTRAX_MPMD_CHECK_INPUTS=off`): the shape switch of `inputs`
  unchecked: each process waits for a transfer of a call the other is not making.
* `exit3`: process 1 leaves with code 3 before its second step (with the launcher, and by hand).
* `stall`: process 1 sleeps 30 s before its second call (by hand, with a shorter timeout).
* `save_death` (started without the launcher, which would stop the job itself): process 1
  is killed while its checkpoint save of step 2 is written in the background.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import spectrax_mpmd as mp
from spectrax_core import schedules as S

LAYERS = 3


def make_loss(cuts: tuple[int, ...]):
    def loss(params, x, y):
        for k, w in enumerate(params):
            x = jnp.tanh(x @ w)
            if k in cuts:
                x = mp.sxstage_iter(x)
        return jnp.mean((x - y) ** 2)

    return loss


def data(rows: int = 8, shift: float = 0.0):
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((8, 8)) * 0.4).astype(np.float32) for _ in range(LAYERS)]
    x = rng.standard_normal((16, 8)).astype(np.float32)[:rows] + np.float32(shift)
    y = rng.standard_normal((16, 8)).astype(np.float32)[:rows]
    return params, x, y


def _mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def _attempt(step, params, x, y) -> str | list:
    """The error `step` raised (type and text), or `[loss, reference loss]`."""
    try:
        loss, _ = step(params, x, y)
    except mp.MpmdError as err:
        return f"{type(err).__name__}: {err}"
    reference = jax.value_and_grad(make_loss(()))(params, x, y)[0]
    return [float(loss), float(reference)]


def built() -> dict:
    me = jax.process_index()
    params, x, y = data()
    cases = {
        "markers": ((0,) if me == 0 else (1,), S.Std1F1B(microbatches=2)),
        "schedule": ((0,), S.Std1F1B(microbatches=2) if me == 0 else S.GPipe(microbatches=2)),
        "micro": ((0,), S.Std1F1B(microbatches=2 if me == 0 else 4)),
        "same": ((0,), S.Std1F1B(microbatches=2)),
    }
    results = {}
    for case, (cuts, schedule) in cases.items():
        step = mp.sxvalue_and_grad(make_loss(cuts), mesh=_mesh(), schedule=schedule)
        if case == "same":
            shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x, y))
            results["prepared"] = step.prepare(*shapes)["compiled"]
        results[case] = _attempt(step, params, x, y)
        if case == "same":
            results["builds"] = len(step.cache)
    step = mp.sxvalue_and_grad(make_loss((0,)), mesh=_mesh(), schedule=cases["schedule"][1])
    try:
        step.prepare(params, x, y)
    except mp.MpmdError as err:
        results["prepare schedule"] = f"{type(err).__name__}: {err}"
    return results


def inputs() -> dict:
    me = jax.process_index()
    step = mp.sxvalue_and_grad(make_loss((0,)), mesh=_mesh(), schedule=S.Std1F1B(microbatches=2))
    results = {f"same {k}": _attempt(step, *data()) for k in range(2)}
    results["values later"] = _attempt(step, *data(shift=0.5 * me))
    results["16 rows"] = _attempt(step, *data(16))
    results["shapes later"] = _attempt(step, *data(8 if me == 0 else 16))
    results["same again"] = _attempt(step, *data())
    return results


def waiting(out: str) -> dict:
    me = jax.process_index()
    step = mp.sxvalue_and_grad(make_loss((0,)), mesh=_mesh(), schedule=S.Std1F1B(microbatches=2))
    results = {"8 rows": _attempt(step, *data()), "16 rows": _attempt(step, *data(16))}
    _write(out, "waiting", results)
    results["switched"] = _attempt(step, *data(8 if me == 0 else 16))
    return results


def _second_call_after(act) -> dict:
    """A first call on both processes; then process 1 does `act` (leaves, or sleeps) before the
    second, which process 0 makes at once."""
    step = mp.sxvalue_and_grad(make_loss((0,)), mesh=_mesh(), schedule=S.Std1F1B(microbatches=2))
    results = {"first": _attempt(step, *data())}
    if jax.process_index() == 1:
        act()
    print(f"second call at {time.time():.3f}", flush=True)
    results["second"] = _attempt(step, *data())
    print(f"refused at {time.time():.3f}", flush=True)
    return results


def exit3() -> dict:
    return _second_call_after(lambda: os._exit(3))


def stall() -> dict:
    return _second_call_after(lambda: time.sleep(30))


def save_death(out: str) -> dict:
    """Save step 1 and wait; process 1 ends (SIGKILL) right after `save(2)` returns, while orbax
    writes and commits step 2 in the background; process 0 learns of it in `save(2)` or while
    waiting for it, whichever it reaches first."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    params = {"w": jax.make_array_from_callback((64, 8), sharding, lambda i: np.ones((64, 8), np.float32)[i])}
    manager = mp.CheckpointManager(os.path.join(out, "ckpt"))
    manager.save(1, params=params)
    manager.wait_until_finished()
    _write(out, "save_death", {"committed": manager.all_steps()})
    print(f"saving step 2 since {time.time():.3f}", flush=True)
    manager.save(2, params=params)
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    manager.wait_until_finished()
    return {"committed": manager.all_steps()}


def _write(out: str, mode: str, results: dict) -> None:
    with open(os.path.join(out, f"{mode}_p{jax.process_index()}.json"), "w") as f:
        json.dump(results, f)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    mp.initialize()
    run = {
        "built": built,
        "inputs": inputs,
        "waiting": lambda: waiting(out),
        "exit3": exit3,
        "stall": stall,
        "save_death": lambda: save_death(out),
    }[mode]
    _write(out, mode, run())
    print(f"{mode}: done", flush=True)


if __name__ == "__main__":
    main()
