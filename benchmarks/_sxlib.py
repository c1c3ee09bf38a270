"""The optional AGPL `spectrax-lib` package's train step on the benchmark's model, for comparison.

Measured only; none of its code is used by SpectraX. When it is absent or
unusable, `load` returns None and its column reads n/a.
"""

from __future__ import annotations

import jax
import numpy as np


class SxLib:
    """spectrax-lib's `sxjit` + `sxvalue_and_grad` on `ranks` ranks with `micro` microbatches."""

    def __init__(self, micro: int, ranks: int):
        from spectrax.runtime import schedules
        from spectrax.runtime.mpmd import sxjit, sxstage_iter, sxvalue_and_grad
        from spectrax.runtime.types import MpMdMesh

        self.sxjit, self.marker, self.value_and_grad, self.MpMdMesh = (
            sxjit,
            sxstage_iter,
            sxvalue_and_grad,
            MpMdMesh,
        )
        self.ranks = ranks
        self.schedules = {
            "GPipe": lambda: schedules.GPipe(microbatches=micro),
            "Std1F1B": lambda: schedules.Std1F1B(microbatches=micro),
            "ZeroBubbleH1": lambda: schedules.ZeroBubbleH1(microbatches=micro),
            "InterleavedH1(v=2)": lambda: schedules.InterleavedH1(microbatches=micro, virtual_stages=2),
            "DualPipeV": lambda: schedules.DualPipeV(microbatches=micro),
        }

    def step(self, name: str, mesh, args, loss_fn):
        """Its step for schedule `name` as a no-argument callable, or None (reason printed).

        Its runtime wants each leaf already on the rank of the one stage that uses it, so
        the params of logical stage s (and x on the first stage, y on the last) are placed on
        the rank its schedule maps s to, before any timing; its loss and gradients are
        checked against `jax.value_and_grad` first.
        """
        if name not in self.schedules:
            print(f"spectrax-lib column n/a for {name}: it has no equivalent schedule.")
            return None
        try:
            sched = self.schedules[name]()
            v = sched.virtual_stages_per_rank()
            owner = {sched.logical_at(r, j, self.ranks): r for r in range(self.ranks) for j in range(v)}
            lib_mesh = self.MpMdMesh(mesh.jax_mesh, "pp")

            def put(a, logical):
                where = jax.sharding.NamedSharding(
                    lib_mesh.submesh(owner[logical]), jax.sharding.PartitionSpec()
                )
                return jax.device_put(a, where)

            params, (x, y) = args
            placed = [
                {"w": put(p["w"], v * k), "b": put(p["b"], v * k + v - 1)} for k, p in enumerate(params)
            ]
            lib_args = (placed, (put(x, 0), put(y, self.ranks * v - 1)))
            fn = self.sxjit(
                lambda p, bt: loss_fn(p, bt, v=v, marker=self.marker),
                mesh=lib_mesh,
                schedule=sched,
                batch_argnums=(1,),
            )
            step = self.value_and_grad(fn)
            loss, (grads,) = jax.block_until_ready(step(*lib_args))
        except Exception as e:  # a third-party package: report, never stop the benchmark
            print(f"spectrax-lib column n/a for {name}: building its step failed ({type(e).__name__}: {e})")
            return None
        want = jax.value_and_grad(lambda p, bt: loss_fn(p, bt, marker=None))(*args)
        got = (loss, grads)
        if not all(
            np.allclose(a, b, rtol=1e-5, atol=1e-7)
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        ):
            print(
                f"NOTE spectrax-lib {name}: loss/grads differ from jax.value_and_grad; "
                "its timing is still shown."
            )
        return lambda: step(*lib_args)


def load(micro: int, ranks: int) -> SxLib | None:
    """The spectrax-lib driver, or None (reason printed once)."""
    try:
        lib = SxLib(micro, ranks)
    except Exception as e:  # ImportError when absent; anything else when installed but unusable
        print(f"spectrax-lib column skipped: import spectrax failed ({type(e).__name__}: {e}).")
        return None
    print("spectrax-lib found: its sxjit + sxvalue_and_grad is the sxlib column.")
    return lib
