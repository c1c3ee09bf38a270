"""Multi-process MPMD train steps against the single-process step of the same model.

Model: a 4-layer tanh MLP (D=256, B=64, the small config of `mpmd_overhead.py`), MSE
loss, 4 pipeline ranks, Std1F1B with m=8 microbatches. Three layouts of the same 4
ranks, each its own job (CPU devices, loopback):

  1 x 4   one process holding all four ranks (today's single-process runtime)
  2 x 2   two processes, two ranks each (`python -m spectrax_mpmd.launch --nproc 2`)
  4 x 1   four processes, one rank each

Per layout, `--rounds` rounds of `--calls` steps (each call waited for: the loss and
this process's gradients): step wall time min, median and spread ((max - min) /
median), and each process's issuing-thread CPU time per step (`time.thread_time`
around the calls: the host cost of issuing its own ranks' cells, transfers and the
wait for its receives). Layouts are separate jobs, so their rounds are not
interleaved with each other; rounds within a job are. Transfer latency per MiB
(2 x 2 job, process 0 -> process 1, median over rounds): the runtime's
`jax.experimental.transfer` pull, a jitted `ppermute` over a two-process mesh (for
comparison; the runtime does not use it), and the in-process device-to-device copy.

On this 2-core machine the processes compete for the same cores, so wall time does
not show the pipeline's speed-up; issue CPU per process is the figure that should
fall as 1/processes.

    python benchmarks/multihost.py [--rounds 5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _timing import summary

LAYOUTS = ((1, 4), (2, 2), (4, 1))
D, B, LAYERS, M = 256, 64, 4, 8
MIB = 1 << 20


# --- the worker (one per process) ----------------------------------------------------------------


_BARRIERS: dict = {}


def _barrier(world: int) -> None:
    """A barrier through the key-value store (a device collective here could deadlock with a
    transfer still being pulled; see docs/multihost.md)."""
    if world > 1:
        from spectrax_mpmd._exchange import Exchange

        _BARRIERS.setdefault("x", Exchange("benchmark-barrier")).allgather("")


def _mlp_loss(params, batch):
    import jax.numpy as jnp

    import spectrax_mpmd as mp

    x, y = batch
    h = x
    for k, layer in enumerate(params):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if k < len(params) - 1:
            h = mp.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


def _step_figures(world: int, rounds: int, calls: int) -> dict:
    import jax
    import numpy as np

    import spectrax_mpmd as mp
    from spectrax_core import schedules as S

    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), "b": np.zeros(D, np.float32)}
        for _ in range(LAYERS)
    ]
    batch = tuple(rng.standard_normal((B, D)).astype(np.float32) for _ in range(2))
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    step = mp.sxvalue_and_grad(_mlp_loss, mesh=mesh, schedule=S.Std1F1B(microbatches=M))
    params, batch = jax.device_put((params, batch), jax.local_devices()[0])

    def call():
        loss, grads = step(params, batch)
        return loss, [g for g in jax.tree.leaves(grads) if g.is_fully_addressable]

    for _ in range(3):
        jax.block_until_ready(call())
    wall, cpu = [], []
    for _ in range(rounds):
        _barrier(world)
        w, c = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            jax.block_until_ready(call())
        cpu.append((time.thread_time() - c) / calls)
        wall.append((time.perf_counter() - w) / calls)
    return {"wall": wall, "cpu": cpu}


def _copy_per_mib(rounds: int, mib: int) -> float | None:
    """In-process device-to-device copy (the runtime's `_transfer` path), seconds per MiB."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from spectrax_mpmd._transfer import transfer

    local = jax.local_devices()
    if len(local) < 2:
        return None
    src, dst = SingleDeviceSharding(local[0]), SingleDeviceSharding(local[1])
    x = jax.block_until_ready(jax.device_put(jnp.ones(mib * MIB // 4, jnp.float32), src))
    move = transfer([src], [dst])
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(move(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times) / mib


def _transfer_server_per_mib(rounds: int, mib: int) -> float | None:
    """Process 0 -> process 1 through the runtime's transport (`jax.experimental.transfer`)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from spectrax_mpmd._transport import TransferServerTransport

    t = TransferServerTransport()
    me = jax.process_index()
    dev = jax.local_devices()[0]
    spec = jax.ShapeDtypeStruct((mib * MIB // 4,), jnp.float32, sharding=SingleDeviceSharding(dev))
    times = []
    for r in range(rounds):
        if me == 0:
            x = jax.block_until_ready(jax.device_put(jnp.full(spec.shape, r, jnp.float32), dev))
            t.server.await_pull(1000 + r, [x])
        _barrier(2)
        if me == 1:
            start = time.perf_counter()
            jax.block_until_ready(t.connection(0).pull(1000 + r, [spec]))
            times.append(time.perf_counter() - start)
        _barrier(2)
    return statistics.median(times) / mib if times else None


def _ppermute_per_mib(rounds: int, mib: int) -> float | None:
    """A jitted `shard_map` + `ppermute` over one device of each process (both directions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = [next(d for d in jax.devices() if d.process_index == p) for p in (0, 1)]
    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    n = mib * MIB // 4

    @jax.jit
    def swap(x):
        return jax.shard_map(
            lambda s: jax.lax.ppermute(s, "x", [(0, 1), (1, 0)]),
            mesh=mesh,
            in_specs=PartitionSpec("x"),
            out_specs=PartitionSpec("x"),
        )(x)

    local = jnp.ones((n,), jnp.float32)
    x = jax.make_array_from_single_device_arrays(
        (2 * n,), sharding, [jax.device_put(local, jax.local_devices()[0])]
    )
    jax.block_until_ready(swap(x))
    times = []
    for _ in range(rounds):
        _barrier(2)
        start = time.perf_counter()
        jax.block_until_ready(swap(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / mib


def worker(out: str, rounds: int, calls: int) -> None:
    world = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    if world > 1:
        import spectrax_mpmd as mp

        mp.initialize()
    import jax

    result = {"process": jax.process_index(), "world": world, **_step_figures(world, rounds, calls)}
    if jax.process_index() == 0:
        result["copy_s_per_mib"] = _copy_per_mib(rounds, 4)
    if world == 2:
        result["transfer_server_s_per_mib"] = _transfer_server_per_mib(rounds, 4)
        result["ppermute_s_per_mib"] = _ppermute_per_mib(rounds, 4)
    Path(out, f"p{jax.process_index()}.json").write_text(json.dumps(result))


# --- the driver ------------------------------------------------------------------------------------


def _run_layout(nproc: int, devices: int, rounds: int, calls: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--worker", out, "--rounds", str(rounds), "--calls", str(calls)]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        if nproc == 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            cmd = [sys.executable, *me]
        else:
            launch = [sys.executable, "-m", "spectrax_mpmd.launch", "--nproc", str(nproc)]
            cmd = [*launch, "--devices-per-proc", str(devices), *me]
        subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("p*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per layout (default 5)")
    ap.add_argument("--calls", type=int, default=5, help="steps per round (default 5)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "multihost.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.calls)
        return
    rows, transfers = [], {}
    for nproc, devices in LAYOUTS:
        procs = _run_layout(nproc, devices, args.rounds, args.calls)
        wall = [max(p["wall"][r] for p in procs) for r in range(args.rounds)]  # the slowest process
        row = {"layout": f"{nproc} x {devices}", "processes": nproc, **summary(wall, procs[0]["cpu"])}
        row["cpu_per_process_ms"] = [statistics.median(p["cpu"]) * 1e3 for p in procs]
        rows.append(row)
        for p in procs:
            for key in ("copy_s_per_mib", "transfer_server_s_per_mib", "ppermute_s_per_mib"):
                if p.get(key) is not None:
                    transfers[key.removesuffix("_s_per_mib")] = p[key] * 1e3
    base = rows[0]["median_ms"]
    base_cpu = statistics.mean(rows[0]["cpu_per_process_ms"])
    print(f"MLP D={D} B={B}, {LAYERS} ranks, Std1F1B m={M}; {args.rounds} rounds x {args.calls} steps")
    print(
        f"{'layout':8} {'min ms':>8} {'median':>8} {'spread':>7} {'ratio':>6}  issue CPU ms/step per process"
    )
    for row in rows:
        row["ratio"] = row["median_ms"] / base
        row["cpu_ratio"] = statistics.mean(row["cpu_per_process_ms"]) / base_cpu
        cpus = " ".join(f"{c:6.1f}" for c in row["cpu_per_process_ms"])
        print(
            f"{row['layout']:8} {row['min_ms']:8.1f} {row['median_ms']:8.1f} {row['spread']:7.2f} "
            f"{row['ratio']:6.2f}  {cpus}  (mean {row['cpu_ratio']:.2f}x single)"
        )
    print("transfer latency, ms per MiB (4 MiB messages, median):")
    for key, ms in transfers.items():
        print(f"  {key:16} {ms:6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": rows, "transfer_ms_per_mib": transfers}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
