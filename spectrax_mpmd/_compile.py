"""Cell specs and their compilation for one submesh each.

A `CellSpec` is a cell function with its input specs (shapes, dtypes and
shardings), output shardings and donated inputs: everything `jax.jit` needs to
lower it. `Compiler` compiles specs once per (program, devices) and can compile
many at once.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax


def _sds(aval, sharding):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


@dataclass(frozen=True)
class CellSpec:
    """A cell function with its input specs, output shardings and donated inputs, not yet compiled."""

    key: Any
    fn: Callable
    in_specs: tuple
    out_shardings: tuple
    donate: tuple = ()

    def fuse(self, other: "CellSpec") -> "CellSpec":
        """One cell running `self` then `other` on disjoint inputs (a fused F&B action)."""
        n = len(self.in_specs)
        first, second = self.fn, other.fn

        def fused(*flat):
            return (*first(*flat[:n]), *second(*flat[n:]))

        return CellSpec(
            ("fused", self.key, other.key),
            fused,
            self.in_specs + other.in_specs,
            tuple(self.out_shardings) + tuple(other.out_shardings),
            tuple(self.donate) + tuple(n + d for d in other.donate),
        )


class Compiler:
    """Compiles cell functions for a submesh, sharing programs that are the same."""

    def __init__(self):
        self.cache: dict = {}

    def compile_spec(self, spec: CellSpec):
        return self.compile(spec.key, spec.fn, list(spec.in_specs), spec.out_shardings, spec.donate)

    def compile(self, key, fn, in_specs, out_shardings, donate=()):
        full_key = self._key(key, in_specs, out_shardings, donate)
        if full_key not in self.cache:
            self.cache[full_key] = self._lower(fn, in_specs, out_shardings, donate).compile()
        return self.cache[full_key]

    def prefetch(self, specs) -> None:
        """Compile every spec not cached yet: lower one by one, then run XLA compiles in parallel.

        XLA's compiler releases the GIL, so independent stage programs compile
        concurrently; this is build-time only (the step itself uses no threads).
        """
        todo = {}
        for spec in specs:
            key = self._key(spec.key, spec.in_specs, spec.out_shardings, spec.donate)
            if key not in self.cache and key not in todo:
                todo[key] = self._lower(spec.fn, list(spec.in_specs), spec.out_shardings, spec.donate)
        if len(todo) < 2:
            for key, lowered in todo.items():
                self.cache[key] = lowered.compile()
            return
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            for key, compiled in zip(todo, pool.map(lambda low: low.compile(), todo.values())):
                self.cache[key] = compiled

    @staticmethod
    def _key(key, in_specs, out_shardings, donate):
        dev_key = tuple((tuple(d.id for d in s.sharding.device_set), str(s.sharding.spec)) for s in in_specs)
        outs = out_shardings if isinstance(out_shardings, tuple) else (out_shardings,)
        out_key = tuple(None if o is None else (tuple(d.id for d in o.device_set), str(o.spec)) for o in outs)
        return (key, dev_key, tuple((s.shape, str(s.dtype)) for s in in_specs), out_key, tuple(donate))

    @staticmethod
    def _lower(fn, in_specs, out_shardings, donate):
        in_shardings = tuple(s.sharding for s in in_specs)
        jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings, donate_argnums=donate)
        return jitted.lower(*in_specs)
