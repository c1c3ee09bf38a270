"""Every process of a multi-process job must pass the same arguments: checked, not assumed.

Each process places only the argument leaves its own ranks read. Processes that
passed different values (a data loader seeded with the process index) would
train on a mixture of them (the first stage on one process's inputs, the last
on another's targets), and processes that passed different shapes (one host's
last partial batch) would build different plans whose transfers cannot pair up.

So before a call is built or run, every process sends a fingerprint of its call
through the `jax.distributed` key-value store: the number of arguments, static
values, each argument's tree structure, each leaf's shape, dtype and weak type,
a CRC-32 of each leaf's bytes, and JAX's trace configuration. Equal fingerprints
cost one exchange of a short digest; different ones raise `DistributedError` on
every process, naming the first argument that differs and the call. A leaf this
process cannot read (a global array held by another process, such as a
parameter updated by `StagedOptimizer` on its owner) is compared by shape and
dtype only.

`$SPECTRAX_MPMD_CHECK_INPUTS` chooses what and when: `host` (default: every
call, reading the values of the leaves in host memory, NumPy arrays and Python
scalars as a data loader hands them over, and of device arrays at each
signature's first call only, since reading those would wait for the device),
`always` (every call, every readable leaf), `first` (each signature's first
call) or `off`.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable

import jax
import numpy as np

from .._comm import RENDEZVOUS_TIMEOUT, Exchange, Peers, check_joined, exit_without_shutdown_barrier
from .._env import CHECK_INPUTS_ENV, TIMEOUT_ENV, configured_input_check, configured_timeout
from .._trace.args import Signature, describe_argument
from .._trace.context import config_key
from ..errors import DistributedError
from .same_build import BuildCheck, digest, stable_repr

def _value_digest(leaf, devices: bool = True) -> str:
    """A CRC-32 of the leaf's bytes (a checksum, not a cryptographic hash: it tells accidental
    differences apart at several GB/s), or `"?"` when this process cannot read the leaf, it has
    no values (a `jax.ShapeDtypeStruct`, as `owner_shardings` takes), or it is a device array and
    `devices` is False."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return "?"
    if isinstance(leaf, jax.Array):
        if not (devices and leaf.is_fully_addressable):
            return "?"
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
    data = np.ascontiguousarray(np.asarray(leaf)).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data):08x}"


def _type(shape, dtype, weak) -> str:
    return f"{dtype}{list(shape)}{' weak' if weak else ''}"


def _rows(sig: Signature, leaves: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The call's rows around `leaves`: count, statics, trees, the leaves, JAX's configuration."""
    rows = [("count", str(len(sig.positions) + len(sig.statics)))]
    rows += [(f"static {k}", stable_repr((type(v), v))) for k, v in sig.statics]
    rows += [(f"tree {k}", stable_repr(t)) for k, t in zip(sig.positions, sig.in_tree.children())]
    return rows + leaves + [("config", stable_repr(config_key()))]


def _structure(sig: Signature) -> list[tuple[str, str]]:
    """The rows of the call that do not read values (each leaf by its type only)."""
    return _rows(sig, [(f"type {a}", _type(*t)) for a, t in enumerate(sig.types)])


def fingerprint(sig: Signature, devices: bool = True) -> list[tuple[str, str]]:
    """The call as `(what, record)` rows that every process must agree on; `what` names the row
    for `_difference` (a leaf is described only when it differs: describing one is costly).
    `devices=False` leaves device arrays' values out (`"?"`)."""
    leaves = [
        (f"leaf {a}", f"{_type(*t)}|{_value_digest(leaf, devices)}")
        for a, (leaf, t) in enumerate(zip(sig.leaves, sig.types))
    ]
    return _rows(sig, leaves)


def _agree(what: str, records: list[str]) -> bool:
    """Whether the processes' records of `what` are equal (a leaf's `?` value matches any value)."""
    if not what.startswith("leaf "):
        return len(set(records)) == 1
    types = {r.rpartition("|")[0] for r in records}
    values = {r.rpartition("|")[2] for r in records} - {"?"}
    return len(types) == 1 and len(values) <= 1


def _difference(what: str, records: list[str], fn: Callable, sig: Signature) -> str:
    """The sentence naming what differs among the processes' `records` of `what`."""
    kind, _, index = what.partition(" ")
    if kind == "count":
        name, show = "the number of positional arguments", records
    elif kind == "static":
        name, show = f"the static {describe_argument(fn, int(index))}", records
    elif kind == "tree":
        name, show = f"the structure of {describe_argument(fn, int(index))}", records
    elif kind == "config":
        name, show = "JAX's configuration (jax.config flags that change tracing)", records
    else:
        name = sig.describe(fn, int(index))
        types = [r.rpartition("|")[0] for r in records]
        if len(set(types)) > 1:
            name, show = f"the shape or dtype of {name}", types
        else:
            holders: dict = {}
            for p, r in enumerate(records):
                holders.setdefault(r.rpartition("|")[2], []).append(str(p))
            groups = " vs ".join(
                f"process{'es' if len(ps) > 1 else ''} {', '.join(ps)}"
                for value, ps in holders.items()
                if value != "?"
            )
            return f"{name} ({types[0]}) has different values ({groups})"
    listed = ", ".join(f"process {p}: {_shorten(r)}" for p, r in enumerate(show))
    return f"{name} differs ({listed})"


def _shorten(record: str, limit: int = 300) -> str:
    """`record`, cut for an error message (a large model's tree structure runs long)."""
    return record if len(record) <= limit else record[:limit] + " ..."


class InputsCheck:
    """The check for one pipelined function (`sxjit`, `sxvalue_and_grad`, ...): call it with
    every call's signature before the call is built or run."""

    def __init__(self, name: str, fn: Callable, mesh):
        self.name, self.fn, self.mesh = name, fn, mesh
        self.mode: str | None = None  # decided at the first call
        self.exchange: Exchange | None = None
        self.build_check = BuildCheck(name, mesh)
        self.peers: Peers | None = None  # made at the first exchange: a peer's end seen at once
        self.limits: tuple = ()  # (a signature's first call's wait, a later call's), at the first call
        self.calls = 0
        self.structures: dict = {}  # signature key -> digest of its structure rows

    def __call__(self, sig: Signature, first: bool) -> None:
        """Check `sig` against every other process's call (as `$SPECTRAX_MPMD_CHECK_INPUTS`
        says); a no-op when the mesh lies in this process."""
        if self.mode is None:
            check_joined(self.name)
            # decided alike on every process (a process outside the mesh too): does it span processes
            self.mode = configured_input_check() if self.build_check.spans else "off"
            # a signature's first call may find the others still compiling; later calls run in step
            self.limits = (max(configured_timeout(), RENDEZVOUS_TIMEOUT), configured_timeout())
        self.calls += 1
        if self.mode == "off" or (self.mode == "first" and not first):
            return
        if self.exchange is None:
            self.exchange = Exchange("inputs", self.limits[0])
        devices = first or self.mode == "always"
        structure = self.structures.get(sig.key)
        if structure is None:
            structure = self.structures[sig.key] = digest("\n".join(r for _, r in _structure(sig)))
        values = "".join(_value_digest(leaf, devices) for leaf in sig.leaves)
        limit = self.limits[0] if first else self.limits[1]
        if len(set(self._allgather(digest(structure + values), limit))) == 1:
            return
        rows = fingerprint(sig, devices)
        tables = [json.loads(t) for t in self._allgather(json.dumps([r for _, r in rows]), limit)]
        if len({len(t) for t in tables}) > 1:  # different structures: the first row that differs says which
            width = min(len(t) for t in tables)
            tables = [t[:width] for t in tables]
        for k, (what, _) in enumerate(rows[: len(tables[0])]):
            records = [t[k] for t in tables]
            if not _agree(what, records):
                self.exchange.raise_together(
                    DistributedError(
                        f"{self.name}: the processes of the job passed different arguments to call "
                        f"{self.calls}: {_difference(what, records, self.fn, sig)}. Every process must "
                        "pass the same arguments (the whole batch, not a per-process shard): each feeds "
                        "only its own ranks, so different inputs would be mixed. Drop or pad a last "
                        f"partial batch alike on every process. {CHECK_INPUTS_ENV}=off skips this check."
                    )
                )

    def same_build(self, plan) -> None:
        """Refuse a newly built `plan` that another process built differently (`BuildCheck`)."""
        self.build_check(plan, self.peers)

    def _allgather(self, value: str, limit: float) -> list[str]:
        if self.peers is None:
            self.peers = Peers(self.limits[0])
        try:
            return self.exchange.allgather(value, limit, self.peers)
        except DistributedError as err:
            exit_without_shutdown_barrier()  # a peer lost or stalled: the job cannot go on
            raise type(err)(
                f"{self.name}: comparing the arguments of call {self.calls} with the other processes: "
                f"{err} Every process must make the same calls in the same order; raise the limit with "
                f"{TIMEOUT_ENV}=<seconds> if a process may take that long between two calls."
            ) from err
