"""What JAX's persistent compilation cache saves a pipelined step's first call.

Runs the same first call (a 4-stage MLP, D=256, B=64, m=8) in fresh processes
sharing one cache directory: the first process compiles and fills the cache,
later ones load the programs from it. Prints each process's first call and its
phases (`step.timings()`), with the cache on and off, and writes JSON.

    python benchmarks/compile_cache.py [--processes 3] [--schedule Std1F1B]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = "--child"


def child(schedule_name: str, cache_dir: str | None) -> None:
    """One process: enable the cache (if a directory is given), run one first call, print JSON."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax

    if cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp
    from _timing import once

    import spectrax_mpmd as mp
    from spectrax_core import schedules as S

    def loss(params, batch):
        x, y = batch
        h = x
        for k, layer in enumerate(params):
            h = jnp.tanh(h @ layer["w"] + layer["b"])
            if k < len(params) - 1:
                h = mp.sxstage_iter(h)
        return jnp.mean((h - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 6)
    params = [{"w": jax.random.normal(k, (256, 256)) / 16, "b": jnp.zeros(256)} for k in keys[:4]]
    batch = (jax.random.normal(keys[4], (64, 256)), jax.random.normal(keys[5], (64, 256)))
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=getattr(S, schedule_name)(microbatches=8))
    first_s, first_cpu_s = once(lambda: step(params, batch))  # CPU: the process's, every thread
    print(json.dumps({"first_s": first_s, "first_cpu_s": first_cpu_s, **step.timings()}))


def run(processes: int, schedule: str, cache_dir: str | None) -> list[dict]:
    rows = []
    for k in range(processes):
        out = subprocess.run(
            [sys.executable, __file__, CHILD, schedule, cache_dir or ""],
            capture_output=True,
            text=True,
            check=True,
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"cache": bool(cache_dir), "process": k + 1, **row})
        s = row["seconds"]
        print(
            f"{'on' if cache_dir else 'off':>5} {k + 1:>7} {row['first_s']:>8.2f} {s['lower']:>7.3f} "
            f"{s['compile']:>8.3f} {s['relocate']:>8.3f} {row['compiled']:>8} {row['relocated']:>6}",
            flush=True,
        )
    return rows


def main():
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(sys.argv[2], sys.argv[3] or None)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--schedule", default="Std1F1B")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "compile_cache.json"))
    args = ap.parse_args()
    print(
        f"{'cache':>5} {'process':>7} {'first s':>8} {'lower':>7} {'compile':>8} {'reloc s':>8} "
        f"{'compiled':>8} {'reloc':>6}"
    )
    rows = run(args.processes, args.schedule, None)
    with tempfile.TemporaryDirectory() as cache_dir:
        rows += run(args.processes, args.schedule, cache_dir)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
