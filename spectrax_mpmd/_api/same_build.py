"""Every process of a multi-process job must build the same step: checked, not assumed.

Each process traces, splits and plans the step by itself and runs only its own
ranks' share. Processes that built different steps (another schedule, another
microbatch count, stage markers in other places, another library version) pair
their transfers up wrongly: they hang, blame a live peer, or, when the edge
shapes happen to agree, train a model made of parts of each split without any
error. So after a signature's plan is built and before it first runs, every
process sends a fingerprint of what it built through the `jax.distributed`
key-value store: the library and JAX versions, the mesh, the schedule, its
microbatch count and each rank's action table, and per stage its boundary (the
shapes, dtypes and shardings of its inputs and outputs) and a digest of its
program. Equal fingerprints cost one exchange of a short digest; different ones
raise `DistributedError` on every process naming the first field that differs
and what each process holds there.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.metadata
import json
import re

import jax

from .._comm import RENDEZVOUS_TIMEOUT, Exchange
from .._env import configured_timeout
from ..errors import DistributedError

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses differ between processes


def stable_repr(value) -> str:
    """`repr(value)` without object addresses (they differ between processes)."""
    return _ADDRESS.sub("", repr(value))


def digest(text: str, size: int = 16) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _sharding(sharding) -> str:
    """A sharding as every process writes it: its kind, spec and devices by global id (a mesh's in
    its order, with its axis names)."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None:
        devices = f"{dict(mesh.shape)} {[d.id for d in mesh.devices.flat]}"
    else:
        devices = str(sorted(d.id for d in sharding.device_set))
    return f"{type(sharding).__name__}({getattr(sharding, 'spec', '')}, {devices})"


def _value(v) -> str:
    aval = getattr(v, "aval", v)
    return aval.str_short() if hasattr(aval, "str_short") else repr(aval)


def _program(stage) -> tuple[str, str]:
    """A stage's program: (a digest of its equations as printed, a short description)."""
    text = stable_repr("\n".join(str(eqn) for eqn in stage.eqns))
    counts = collections.Counter(eqn.primitive.name for eqn in stage.eqns)
    common = ", ".join(f"{name} x{n}" for name, n in counts.most_common(4))
    program = digest(text, 8)
    return program, f"{len(stage.eqns)} equations ({common}{', ...' if len(counts) > 4 else ''}) #{program}"


def fingerprint(plan, mesh) -> list[tuple[str, str, str]]:
    """What this process built, as `(field, record, shown)` rows every process must agree on:
    `record` is compared, `shown` is what an error prints of it."""
    rows = []

    def add(field: str, record: str, shown: str | None = None) -> None:
        rows.append((field, record, record if shown is None else shown))

    add(
        "the library versions",
        f"spectrax-mpmd {_version('spectrax-mpmd')}, jax {jax.__version__}, jaxlib {_version('jaxlib')}",
    )
    for rank in range(mesh.mpmd_dim):  # ranks may own submeshes of different shapes
        sub = mesh.submesh(rank)
        add(f"rank {rank}'s devices", f"{dict(sub.shape)} {[d.id for d in sub.devices.flat]}")
    schedule, n = plan.schedule, mesh.mpmd_dim
    add("the microbatch count", str(schedule.microbatches))
    add("the schedule", stable_repr(schedule))
    table = schedule.actions(n)
    for rank, actions in enumerate(table):
        listed = " ".join(map(str, actions))
        add(
            f"rank {rank}'s schedule table",
            digest(listed, 8),
            listed if len(listed) <= 200 else listed[:200] + " ...",
        )
    graph = plan.graph
    add("the number of stages", str(len(graph.stages)))
    for stage in graph.stages:
        ins = [f"arg {a}: {_value(stage.invars[a])}" for a in stage.arg_inputs]
        ins += [f"edge from stage {e.src}: {_value(e.var)}" for e in stage.edge_inputs]
        outs = [_value(v) for v in stage.edge_outputs] + [f"result {j}" for j in stage.results]
        add(f"stage {stage.index}'s boundary", f"in [{', '.join(ins)}] out [{', '.join(outs)}]")
        add(f"stage {stage.index}'s program", *_program(stage))
    for (stage, kind), spec in sorted(plan.cells.items(), key=lambda item: repr(item[0])):
        shardings = [_sharding(s.sharding) for s in spec.in_specs if hasattr(s, "sharding")]
        shardings += [_sharding(s) for s in spec.out_shardings if s is not None]
        add(f"the shardings of stage {stage}'s {kind} cell", "; ".join(shardings))
    return rows


class BuildCheck:
    """The check for one pipelined function: call it with each newly built plan before it runs."""

    def __init__(self, name: str, mesh):
        self.name, self.mesh = name, mesh
        self.spans = len({d.process_index for d in mesh.devices.flat}) > 1
        self.exchange: Exchange | None = None

    def __call__(self, plan, peers=None) -> None:
        """Refuse, on every process, a plan another process of the job built differently; with
        `peers` (`liveness.Peers`), a process that ended meanwhile is named at once."""
        if not self.spans:
            return
        if self.exchange is None:
            self.exchange = Exchange("build", max(configured_timeout(), RENDEZVOUS_TIMEOUT))
        rows = fingerprint(plan, self.mesh)
        if len(set(self._allgather(digest("\n".join(r for _, r, _ in rows)), peers))) == 1:
            return
        tables = [json.loads(t) for t in self._allgather(json.dumps(rows), peers)]
        self.exchange.raise_together(
            DistributedError(
                f"{self.name}: the processes of the job built different steps: "
                f"{first_difference(tables)}. {_FIX}"
            )
        )

    def _allgather(self, value: str, peers) -> list[str]:
        try:
            return self.exchange.allgather(value, peers=peers)
        except DistributedError as err:
            raise type(err)(
                f"{self.name}: comparing the step each process built: {err} Every process must build "
                "the step (the same function, schedule and arguments) before its first call."
            ) from err


_FIX = (
    "Every process must run the same script with the same settings: the same function with its "
    "stage markers (sxstage_iter) in the same places, the same schedule and microbatch count, and "
    "the same versions of spectrax-mpmd, jax and jaxlib."
)


def first_difference(tables: list[list]) -> str:
    """The first field whose record differs among the processes' `tables` of `(field, record,
    shown)` rows, with what each process holds there."""
    by_field = [{field: (record, shown) for field, record, shown in table} for table in tables]
    order = [field for field, _, _ in max(tables, key=len)]
    for field in order:
        held = [rows.get(field) for rows in by_field]
        if len({h[0] if h else None for h in held}) > 1:
            groups: dict = {}
            for p, h in enumerate(held):
                groups.setdefault(h[1] if h else "nothing", []).append(str(p))
            listed = "; ".join(
                f"process{'es' if len(ps) > 1 else ''} {', '.join(ps)}: {shown}"
                for shown, ps in groups.items()
            )
            return f"{field} differs ({listed})"
    return "their fingerprints differ"
