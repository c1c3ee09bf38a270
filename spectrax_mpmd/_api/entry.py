"""What every call of an entry point goes through: its signature's cached plan, the placement
of its arguments, and the build report and host profile of that plan."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp

from .._compile.compiler import Compiler
from .._runtime import HostProfile, Output, Plan, host_profile
from .._trace.args import DONATING_CALLS, Signature, signature
from .._trace.context import building_for, check_no_trace
from ..errors import MpmdError


class PipelinedFunction(Protocol):
    """What every entry point's callable (`sxjit`'s, `sxvalue_and_grad`'s) is to the calls it
    serves: its function and settings, its compiled plans by signature, and how to build one."""

    name: str
    fn: Callable
    mesh: Any  # the MpmdMesh its plans run on
    static_argnums: tuple
    compiler: Compiler
    placer: Placer
    cache: dict
    inputs_check: Callable

    def build_entry(self, sig) -> Entry: ...


class Placer:
    """Places argument leaves on the ranks that read them.

    A `jax.Array` already committed to the sharding the plan reads it with (a
    previous step's result: parameters and optimizer state in a training loop) is
    used as it is, as `jax.device_put` would return it, without its per-leaf cost.
    Otherwise a `jax.Array` is immutable, so its placement is cached by identity and
    reused while the caller passes the same object; numpy arrays and Python values
    can change in place and are placed again on every call, and so are leaves whose
    key is None (donated ones, consumed by the call).
    """

    def __init__(self):
        self.cache: dict = {}

    def place(self, values: list, shardings: list, keys: list, leaves: Sequence = ()) -> list:
        """`values` on `shardings`; `keys` are their cache keys (None: placed again every call),
        `leaves` the argument leaf each value is (for errors)."""
        out: list = [None] * len(values)
        miss_v, miss_s, miss_i = [], [], []
        for k, (v, sh, key) in enumerate(zip(values, shardings, keys)):
            hit = self.cache.get(key) if key is not None else None
            if hit is not None and hit[0] is v:  # the array placed last time (only arrays are kept)
                out[k] = hit[1]
            elif isinstance(v, jax.Array) and v.committed and v.sharding == sh:
                out[k] = v
            else:
                miss_v.append(v)
                miss_s.append(sh)
                miss_i.append(k)
        if miss_v:
            _check_held_here(miss_v, [leaves[k] if leaves else k for k in miss_i])
            placed = jax.device_put(miss_v, miss_s)
            for k, p in zip(miss_i, placed):
                out[k] = p
                if keys[k] is not None and isinstance(values[k], jax.Array):
                    self.cache[keys[k]] = (values[k], p)
        return out


def _check_held_here(values: list, leaves: list) -> None:
    """Refuse an array held only by other processes' devices (an output of an earlier call that
    another process's rank keeps) where this process's rank reads it: no process can place it."""
    for v, leaf in zip(values, leaves):
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            raise MpmdError(
                f"argument leaf {leaf} is read by a pipeline rank of this process, but the array passed "
                "is held only by another process's devices (a result an earlier call left on the rank "
                "that keeps it); a multi-process call can only place arrays this process holds. Pass "
                "this process its own copy (a host value, or an array on its devices); a parameter "
                "differentiated by the step is brought from its owner's rank by the step itself."
            )


@dataclass
class Entry:
    """A compiled plan with what a call needs around it, all fixed per signature."""

    plan: Plan
    out_tree: Any
    donated: frozenset = frozenset()
    grad_trees: tuple = ()  # per argnum: (treedef, the buffer slot of each leaf's gradient)
    lengths: tuple = ()  # with `LengthBuckets`: each microbatch's length, in schedule order

    def __post_init__(self):
        self.input_leaves = [key.leaf for _, key in self.plan.input_keys]
        self.cache_keys = [None if key.leaf in self.donated else key for _, key in self.plan.input_keys]
        results = set(self.plan.output_slots.get(Output.RESULTS, ()))
        # donated leaves the call returns as they came (their slots are outputs, never consumed)
        self.returned = frozenset(
            key.leaf for slot, key in self.plan.input_keys if key.leaf in self.donated and slot in results
        )
        self.build: dict = {}  # the build's BuildStats report; first_run is filled by the first run
        self.ran = False

    def place(self, placer: Placer, leaves: Sequence) -> list:
        """The argument leaves the plan reads, each on the ranks that read it."""
        values = [leaves[a] for a in self.input_leaves]
        if self.returned:
            self._unalias(values)
        if not values:
            return []
        return placer.place(values, self.plan.input_shardings, self.cache_keys, self.input_leaves)

    def _unalias(self, values: list) -> None:
        """Copy a donated leaf the call returns as it came when the caller passed the same array
        as another donated leaf (which the call consumes), so that it comes back alive."""
        leaves = list(zip(self.input_leaves, values))
        consumed = {id(v) for a, v in leaves if a in self.donated and a not in self.returned}
        for k, (a, v) in enumerate(leaves):
            if a in self.returned and id(v) in consumed:
                values[k] = jnp.copy(v)

    def run(self, placer: Placer, leaves: Sequence) -> list:
        """Place the arguments and run the plan; returns the buffers."""
        if self.ran or not self.build:
            return self.plan.run(self.place(placer, leaves))
        start = time.perf_counter()
        buf = self.plan.run(self.place(placer, leaves))
        self.build["seconds"]["first_run"] = time.perf_counter() - start
        self.build["total_s"] = sum(self.build["seconds"].values())
        self.ran = True
        return buf


def cached_entry(function: PipelinedFunction, args) -> tuple[Entry, list]:
    """`function`'s entry for this call's signature (built on a miss) and the call's leaves.
    A function with a `refine_signature(sig)` method keys and builds its plans by the signature
    it returns, where the plan depends on the arguments' values too (`LengthBuckets`: each
    microbatch's length), with its leaves.

    Refuses calls under a JAX transformation before any cache is read or written.
    """
    check_no_trace(function.name)
    given = sig = signature(function.name, function.fn, args, function.static_argnums)
    refine = getattr(function, "refine_signature", None)
    if refine is not None:
        sig = refine(given)
    entry = function.cache.get(sig.key)
    function.inputs_check(given, first=entry is None)
    if entry is None:
        stats = function.compiler.stats
        stats.reset()
        with stats.timed("plan"), building_for(function.mesh):
            entry = function.build_entry(sig)
        entry.build = stats.report()
        function.inputs_check.same_build(entry.plan)
        if entry.plan.transport is not None:  # before any transfer is in flight, in one order
            entry.plan.transport.open_channels()
        function.cache[sig.key] = entry
    if entry.donated:
        check_donated_once(function, sig, entry.donated, entry.returned)
    function.last_entry = entry
    return entry, sig.leaves


def check_donated_once(
    function: PipelinedFunction, sig: Signature, donated: frozenset, returned: frozenset
) -> None:
    """Refuse, naming both leaves, an array the call consumes (a donated leaf it does not return as
    it came) that is also passed as another leaf it does not return as it came: the call would read
    a buffer it has consumed (XLA refuses such a call mid-step). A leaf returned as it came that
    shares a consumed array is copied instead (`Entry.place`)."""
    leaves = sig.leaves
    if len({id(x) for x in leaves}) == len(leaves):
        return
    at: dict[int, list[int]] = {}
    for a, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            at.setdefault(id(x), []).append(a)
    for same in at.values():
        consumed = [a for a in same if a in donated and a not in returned]
        other = [a for a in same if a not in returned and a != consumed[0]] if consumed else []
        if other:
            first, second = sorted((consumed[0], other[0]))
            raise MpmdError(
                f"{function.name}: {sig.describe(function.fn, second)} is the same array as "
                f"{sig.describe(function.fn, first)}, and the call donates (consumes) "
                f"{sig.describe(function.fn, consumed[0])} ({DONATING_CALLS}), so it cannot read that "
                "array again. An optimizer state that holds the parameter arrays themselves (an init "
                "returning `params`) does this, and so does a batch that is a parameter. Pass a copy "
                "(`jax.tree.map(jnp.copy, opt_state)`), or keep the inputs alive with donate=False "
                "(sxjit: leave the argument out of donate_argnums)."
            )


def host_cost(function: PipelinedFunction, args, rounds: int) -> HostProfile:
    """`function`'s host-cost report for these arguments (see `HostProfile`)."""
    entry, leaves = cached_entry(function, args)
    entry.plan.check_single_process(f"{function.name}.profile")
    return host_profile(entry.plan, fresh_inputs(entry, function.placer, leaves), rounds)


def fresh_inputs(entry: Entry, placer: Placer, leaves: Sequence) -> Callable:
    """Placed inputs for one more run of `entry`'s plan; a donated leaf is copied first, so a
    measurement that runs the plan again and again consumes none of the caller's arrays."""
    if not entry.donated:
        placed = entry.place(placer, leaves)
        return lambda: placed
    return lambda: entry.place(
        placer, [jnp.copy(x) if a in entry.donated else x for a, x in enumerate(leaves)]
    )


class Timings(dict):
    """A build report (`{"seconds": {phase: s}, "total_s": s, "compiled": k, "relocated": k}`) that
    prints as a table: one row per phase with its milliseconds and share of the total."""

    def __repr__(self) -> str:
        total = self["total_s"]
        rows = [f"{'phase':<10} {'ms':>9} {'share':>6}"]
        for phase, seconds in self["seconds"].items():
            rows.append(f"{phase:<10} {seconds * 1e3:9.1f} {seconds / total if total else 0.0:6.1%}")
        rows.append(f"{'total':<10} {total * 1e3:9.1f} {1.0 if total else 0.0:6.1%}")
        rows.append(f"programs compiled: {self['compiled']}, relocated: {self['relocated']}")
        return "\n".join(rows)

    __str__ = __repr__


def prepare(function: PipelinedFunction, args) -> Timings:
    """What a first call with `args`' signature does before it runs, done now (see the steps'
    `prepare`): its build report."""
    if not args:
        raise MpmdError(
            f"{function.name}.prepare: pass the arguments of the calls to prepare for (arrays, or "
            "jax.ShapeDtypeStruct with their shapes and dtypes), as to a call."
        )
    return build_timings(function, args)


def build_timings(function: PipelinedFunction, args) -> Timings:
    """The build report of `args`' signature (building it if needed), or of the last call's."""
    if args:
        return Timings(cached_entry(function, args)[0].build)
    entry = getattr(function, "last_entry", None)
    if entry is None:
        raise MpmdError(f"{function.name}: nothing has been built yet; call it first or pass arguments.")
    return Timings(entry.build)


def build_plan(compiler: Compiler, build, *args) -> Plan:
    """Build a plan; the compiler keeps its compiled programs but no per-build lowerings."""
    try:
        return build(*args, compiler)
    finally:
        compiler.forget_lowerings()
