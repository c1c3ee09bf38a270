"""Cell specs and their compilation for one submesh each.

A `CellSpec` is a cell function with its input specs (shapes, dtypes and
shardings), output shardings and donated inputs: everything `jax.jit` needs to
lower it. `Compiler` compiles each distinct program once and can compile many
at once.

Program identity: two specs share an executable only when they lower to the
same StableHLO text (which holds every constant's value, every custom rule's
effect and every static parameter) for the same devices, shardings and
donations, under the same JAX configuration. Nothing is keyed on a printed
summary or an object id, so a reused executable is provably the same program.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from ._context import config_key


def _sds(aval, sharding):
    return jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=getattr(aval, "weak_type", False)
    )


@dataclass(frozen=True, eq=False)
class CellSpec:
    """A cell function with its input specs, output shardings and donated inputs, not yet compiled.

    Specs compare by identity: a builder reuses one spec object wherever the same
    cell runs, and the compiler lowers each spec object once.
    """

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
            fused,
            self.in_specs + other.in_specs,
            tuple(self.out_shardings) + tuple(other.out_shardings),
            tuple(self.donate) + tuple(n + d for d in other.donate),
        )


def _sharding_key(sharding) -> Any:
    """Everything about a sharding that the executable depends on: devices in order, layout."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return (
            "named",
            tuple(mesh.axis_names),
            mesh.devices.shape,
            tuple(d.id for d in mesh.devices.flat),
            tuple(sharding.spec),
            sharding.memory_kind,
        )
    return (type(sharding).__name__, tuple(sorted(d.id for d in sharding.device_set)), repr(sharding))


class Compiler:
    """Compiles cell specs, sharing one executable between specs that are the same program."""

    def __init__(self):
        self.cache: dict = {}  # program key -> compiled executable
        self._lowered: dict = {}  # spec -> (program key, lowered), for the specs of the current build

    def program_key(self, spec: CellSpec) -> tuple:
        """The identity of `spec`'s program (see the module docstring)."""
        return self._lower(spec)[0]

    def compile_spec(self, spec: CellSpec):
        key, lowered = self._lower(spec)
        if key not in self.cache:
            self.cache[key] = lowered.compile()
        return self.cache[key]

    def prefetch(self, specs) -> None:
        """Compile every spec not cached yet: lower one by one, then run XLA compiles in parallel.

        XLA's compiler releases the GIL, so independent stage programs compile
        concurrently; this is build-time only (the step itself uses no threads).
        """
        todo = {}
        for spec in specs:
            key, lowered = self._lower(spec)
            if key not in self.cache:
                todo.setdefault(key, lowered)
        if len(todo) < 2:
            for key, lowered in todo.items():
                self.cache[key] = lowered.compile()
            return
        with ThreadPoolExecutor(max_workers=min(len(todo), os.cpu_count() or 1)) as pool:
            for key, compiled in zip(todo, pool.map(lambda low: low.compile(), todo.values())):
                self.cache[key] = compiled

    def forget_lowerings(self) -> None:
        """Drop the lowered modules kept for the build that just finished (compiled programs stay)."""
        self._lowered.clear()

    def _lower(self, spec: CellSpec) -> tuple[tuple, Any]:
        hit = self._lowered.get(spec)
        if hit is None:
            in_shardings = tuple(s.sharding for s in spec.in_specs)
            jitted = jax.jit(
                spec.fn,
                in_shardings=in_shardings,
                out_shardings=spec.out_shardings,
                donate_argnums=spec.donate,
            )
            lowered = jitted.lower(*spec.in_specs)
            text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
            outs = spec.out_shardings if isinstance(spec.out_shardings, tuple) else (spec.out_shardings,)
            key = (
                text,
                tuple(_sharding_key(s) for s in in_shardings),
                tuple(_sharding_key(o) for o in outs),
                tuple(spec.donate),
                config_key(),
            )
            hit = self._lowered[spec] = (key, lowered)
        return hit
