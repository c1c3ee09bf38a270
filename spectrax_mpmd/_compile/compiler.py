"""Cell specs and their compilation for one submesh each.

A `CellSpec` is a cell function with its input specs (shapes, dtypes and
shardings), output shardings and donated inputs: everything `jax.jit` needs to
lower it. `Compiler` compiles each distinct program once and can compile many
at once.

Program identity: two specs are the same program when they lower to the same
StableHLO text (which holds every constant's value, every custom rule's effect
and every static parameter) with the same argument and result avals (shape,
dtype, extended dtypes such as typed PRNG keys included, and weak type: the
text shows a typed key as its raw key data and a weak scalar as a strong one),
the same shardings (each device named by its position among the cell's
devices), donations and device kinds, under the same JAX configuration, and
with the same host callbacks: a `jax.pure_callback`, `io_callback` or
`jax.debug.print` lowers to an index into the executable's own list of Python
functions, which the text does not show. Those functions (and the objects
JAX keeps alive with them) enter the key by identity and are held by it, so
their ids cannot be reused while the key exists; where JAX's lowering does not
expose them, every program gets a token of its own and is shared with none.
Same program on the same devices: one executable. Same program on other
devices: compiled once, loaded onto the others. Nothing is keyed on a printed
summary or on the id of an object the key does not hold, so a reused
executable is provably the same program.

Lowering costs far more than tracing, so a cell is identified from its trace
first (`identity.jaxpr_key`: its jaxpr with every constant's value, plus the
same interface as above): a traced program that was lowered before, on any
devices, takes that lowering's identity and is not lowered again. Programs with
side effects are identified from their lowering only.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, SingleDeviceSharding

from .._env import configured_compile_threads
from .._trace.context import config_key, own_mesh
from .identity import Held, jaxpr_key, jaxpr_size
from .relocate import persistent_cache_active, relocate, relocation_available, serialized
from .stats import BuildStats


def shape_spec(aval, sharding):
    """`aval` (shape, dtype, weak type) as a `jax.ShapeDtypeStruct` on `sharding`."""
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

    @property
    def output_shardings(self) -> tuple | None:
        """The outputs' shardings where every one is known before compiling, else None."""
        return None if any(s is None for s in self.out_shardings) else tuple(self.out_shardings)

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


def _aval_key(aval) -> tuple:
    """An argument's or result's abstract value as the executable checks and returns it."""
    return tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False))


def _compile_args(lowered) -> dict | None:
    """What JAX hands the compiler besides the text (private, feature-detected), or None."""
    args = getattr(getattr(lowered, "_lowering", None), "compile_args", None)
    return args if isinstance(args, dict) and "host_callbacks" in args else None


def _host_state(lowered) -> tuple:
    """The host callbacks the executable calls and the objects kept alive with them (by identity),
    and its side effects; without JAX's compile arguments, a token unique to this lowering."""
    args = _compile_args(lowered)
    if args is None:
        return (Held(object()),)
    held = (*(args["host_callbacks"] or ()), *(args.get("keepalive") or ()))
    return (
        tuple(Held(h) for h in held),
        tuple(args.get("ordered_effects") or ()),
        frozenset(args.get("unordered_effects") or ()),
    )


def _mesh_of(shardings):
    """The one mesh a cell's named shardings share (the stage's submesh), else None."""
    meshes = {sh.mesh for sh in shardings if isinstance(sh, NamedSharding)}
    return meshes.pop() if len(meshes) == 1 else None


def _devices_of(shardings) -> tuple:
    """The devices a cell runs on, in order of first appearance among its shardings."""
    seen: dict = {}
    for sh in shardings:
        if sh is not None:
            flat = (
                sh.mesh.devices.flat
                if isinstance(sh, NamedSharding)
                else sorted(sh.device_set, key=lambda d: d.id)
            )
            for d in flat:
                seen.setdefault(d, len(seen))
    return tuple(seen)


def _layout_key(sharding, position: dict) -> Any:
    """Everything about a sharding that the executable depends on, with each device named by
    its position among the cell's devices: the same key on every rank for the same layout."""
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return (
            "named",
            tuple(mesh.axis_names),
            mesh.devices.shape,
            tuple(position[d] for d in mesh.devices.flat),
            tuple(sharding.spec),
            sharding.memory_kind,
        )
    if isinstance(sharding, SingleDeviceSharding):
        return ("single", position[next(iter(sharding.device_set))], sharding.memory_kind)
    return (type(sharding).__name__, tuple(sorted(position[d] for d in sharding.device_set)), repr(sharding))


class Compiler:
    """Compiles cell specs, sharing one executable between specs that are the same program.

    A program is compiled once; a spec that is the same program on other devices
    (another rank's copy of a stage) gets the compiled program loaded onto its
    devices instead (`relocate`), or a fresh compile where that is unavailable.
    `stats` counts both and times each phase of the last build.
    """

    def __init__(self, relocate: bool = True):
        self.cache: dict = {}  # (program, devices) -> compiled executable
        self.sources: dict = {}  # program -> (a compiled instance, its devices)
        self._serialized: dict = {}  # program -> that instance serialized (None: not relocatable)
        self.relocate = relocate and relocation_available()
        self.stats = BuildStats()
        self._lowered: dict = {}  # spec -> ((program, devices), lowered), for the current build
        self.known: dict = {}  # a traced program's key -> the program its lowering is
        self._early: bool | None = None  # whether traced keys are used (known after one lowering)
        self.transport = None  # the cross-process transport, made by the first multi-process build
        # callables given a plan about to be compiled (its cells still specs) that return more
        # specs to compile with its programs, in the same threads (an owner-rank init's programs)
        self.companions: list = []

    def program_key(self, spec: CellSpec) -> tuple:
        """The identity of `spec`'s program and the devices it runs on (see the module docstring)."""
        return self._lower(spec)[0]

    @property
    def relocating(self) -> bool:
        """Whether programs are loaded onto other devices now (not with the persistent cache on)."""
        return self.relocate and not persistent_cache_active()

    def compile_spec(self, spec: CellSpec):
        key, lowered = self._lower(spec)
        if key not in self.cache:
            self._store(key, self._relocated(key) or self._compile(key, lowered))
        return self.cache[key]

    def prefetch(self, specs) -> None:
        """Compile every spec not cached yet: each distinct program once, in worker threads that
        start while the next specs are still being lowered; a program that other devices run too
        is loaded onto them (`relocate`) in the same threads as soon as its compile ends. The
        specs are traced in turn, and whenever a worker is idle the largest traced so far (by
        equations) is lowered and starts compiling: no worker waits for the rest to be traced,
        and those traced while every worker is busy start largest first, so the longest compile
        does not start last.

        XLA's compiler releases the GIL, so stage programs compile concurrently
        with each other and with lowering (`$SPECTRAX_MPMD_COMPILE_THREADS` at a
        time); this is build-time only (the step itself uses no threads).
        """
        todo: dict = {}
        started: dict = {}  # future -> the key it compiles
        pending: dict = {}  # program -> the keys that will load it once compiled
        relocating = self.relocating
        workers = configured_compile_threads()
        traced: dict = {}
        waiting: list = []  # traced, not started yet

        def size(spec) -> int:
            return traced[spec].size if spec in traced else 0

        def start(spec) -> None:
            key, lowered = self._lower(spec, traced.get(spec))
            if key in self.cache or key in todo:
                return
            todo[key] = lowered
            program = key[0] if relocating else key
            if program in self.sources or program in pending:
                pending.setdefault(program, []).append(key)
            else:
                pending[program] = []
                started[pool.submit(self._lowering(lowered).compile)] = key

        with ThreadPoolExecutor(max_workers=workers) as pool:
            for spec in dict.fromkeys(specs):
                if spec not in self._lowered:
                    with self.stats.timed("lower"):
                        traced[spec] = _Traced(spec)
                waiting.append(spec)
                while waiting and sum(not f.done() for f in started) < workers:
                    waiting.sort(key=size)  # an idle worker takes the largest traced so far
                    start(waiting.pop())
            for spec in sorted(waiting, key=size, reverse=True):
                start(spec)
            loads: dict = {}
            for program in [p for p in pending if p in self.sources]:  # compiled by an earlier build
                loads.update(self._load(pool, pending.pop(program)))
            with self.stats.timed("compile"):
                for future in as_completed(started):
                    key = started[future]
                    self._store(key, future.result())
                    self.stats.compiled += 1
                    loads.update(self._load(pool, pending.pop(key[0] if relocating else key, [])))
            with self.stats.timed("relocate"):
                loaded = [(key, future.result()) for key, future in loads.items()]
        for key, compiled in loaded:
            if compiled is not None:
                self.stats.relocated += 1
                self._store(key, compiled)
        for key, lowered in todo.items():  # one that could not be loaded compiles here
            if key not in self.cache:
                self._store(key, self._compile(key, lowered))

    def _load(self, pool, keys: list) -> list:
        """`(key, future of its compiled program loaded onto its devices or None)` per key, in
        `pool`'s threads, from the program's compiled source (serialized here, once)."""
        if not keys:
            return []
        with self.stats.timed("relocate"):
            source = self._source(keys[0][0])
        return [(key, pool.submit(relocate, source, key[1])) for key in keys] if source is not None else []

    def _source(self, program):
        """`program`'s compiled instance serialized for loading elsewhere (None: it cannot be)."""
        if program not in self._serialized:  # serialized on the first relocation only
            self._serialized[program] = serialized(*self.sources[program])
        return self._serialized[program]

    def forget_lowerings(self) -> None:
        """Drop the lowered modules kept for the build that just finished (compiled programs stay)."""
        self._lowered.clear()

    def _lowering(self, lowered):
        """`lowered` as a real lowering (lowering a known program now, where it must compile)."""
        if isinstance(lowered, _Traced):
            with self.stats.timed("lower"):
                lowered = lowered.lower()
            self.stats.lowered += 1
        return lowered

    def _compile(self, key: tuple, lowered):
        lowered = self._lowering(lowered)
        with self.stats.timed("compile"):
            compiled = lowered.compile()
        self.stats.compiled += 1
        return compiled

    def _relocated(self, key: tuple):
        program = key[0]
        if not self.relocating or program not in self.sources:
            return None
        with self.stats.timed("relocate"):
            source = self._source(program)
            compiled = None if source is None else relocate(source, key[1])
        if compiled is not None:
            self.stats.relocated += 1
        return compiled

    def _store(self, key: tuple, compiled) -> None:
        self.cache[key] = compiled
        if self.relocating:
            self.sources.setdefault(key[0], (compiled, key[1]))

    def _lower(self, spec: CellSpec, traced: _Traced | None = None) -> tuple[tuple, Any]:
        """`spec`'s key and its lowering (a `_Traced` not lowered yet when its program is known);
        `traced`: its trace, where taken already."""
        hit = self._lowered.get(spec)
        if hit is None:
            with self.stats.timed("lower"):
                hit = self._lowered[spec] = self._identify(traced or _Traced(spec))
        return hit

    def _identify(self, traced: _Traced) -> tuple[tuple, Any]:
        """A traced spec's key and lowering: a program already lowered (on any devices) is known by
        its traced key and not lowered again, any other is lowered and keyed by its lowering."""
        early = traced.key() if self._early is not False else None
        program = self.known.get(early) if early is not None else None
        if program is not None:
            return (program, traced.devices), traced
        lowered = traced.lower()
        self.stats.lowered += 1
        # a JAX that does not show how it compiles a lowering gets no program shared (module docstring)
        self._early = self._early is not False and _compile_args(lowered) is not None
        key = _lowered_key(lowered, traced)
        if early is not None and self._early:
            self.known[early] = key[0]
        return key, lowered


def _lowered(lowering):
    """A real lowering of what `Compiler._lower` returned."""
    return lowering.lower() if isinstance(lowering, _Traced) else lowering


class _Traced:
    """A cell spec traced by `jax.jit` (with its devices), lowered on demand."""

    def __init__(self, spec: CellSpec):
        self.spec = spec
        self.in_shardings = tuple(s.sharding for s in spec.in_specs)
        outs = spec.out_shardings
        self.out_shardings = outs if isinstance(outs, tuple) else (outs,)
        self.devices = _devices_of((*self.in_shardings, *self.out_shardings))
        self.position = {d: k for k, d in enumerate(self.devices)}
        jitted = jax.jit(
            spec.fn,
            in_shardings=self.in_shardings,
            out_shardings=spec.out_shardings,
            donate_argnums=spec.donate,
            keep_unused=True,  # the text then holds every argument: dropped ones would not show in it
        )
        self.mesh = _mesh_of(self.in_shardings + self.out_shardings)
        with own_mesh(self.mesh):
            self.traced = jitted.trace(*spec.in_specs)

    @property
    def size(self) -> int:
        """How many equations the trace holds, nested ones included: what its compile time grows with."""
        return jaxpr_size(self.traced.jaxpr)

    def key(self) -> tuple | None:
        """The program's identity from its trace (None: only its lowering can tell, see identity)."""
        program = jaxpr_key(self.traced.jaxpr, self.position, _layout_key)
        if program is None:
            return None
        return (program, *self._interface())

    def lower(self):
        with own_mesh(self.mesh):
            return self.traced.lower()

    def _interface(self) -> tuple:
        """Everything besides the program's body its executable depends on."""
        return (
            tuple(_layout_key(s, self.position) for s in self.in_shardings),
            tuple(_layout_key(o, self.position) for o in self.out_shardings),
            tuple(self.spec.donate),
            tuple(_aval_key(a) for a in self.traced.jaxpr.in_avals),
            tuple(_aval_key(a) for a in self.traced.jaxpr.out_avals),
            tuple(d.device_kind for d in self.devices),
            config_key(),
        )


def _lowered_key(lowered, traced: _Traced) -> tuple:
    """(program, devices) of a lowered cell: its text with the interface and host state."""
    text = hashlib.sha256(lowered.as_text().encode()).hexdigest()
    program = (text, *traced._interface(), _host_state(lowered))
    return program, traced.devices
