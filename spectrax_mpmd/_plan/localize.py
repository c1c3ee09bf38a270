"""Localize (multi-process plans): each process keeps only the steps of the pipeline ranks it holds.

Every process of a `jax.distributed` job runs the same script and builds the
same full draft of plan steps (the passes are deterministic). Before anything
is compiled, `localize` rewrites that draft for this process:

* a cell of a rank held here stays; any other cell is dropped (never compiled here);
* a move between two ranks held here stays an in-process copy;
* moves from here to another process become one send step per receiving
  process, moves from another process to here one receive step per sender
  (one transfer group each: one uuid, one pull); moves between two other
  processes are dropped;
* a parameter leaf read by ranks of several processes is placed from the caller's value on its
  owner's rank only (the rank that sums its gradient and updates it: `grad_stage`), and a copy
  is sent from there to its readers in other processes at the start of every call, so the
  updated leaf a step returns (held by the owner's process alone) feeds the next step as it
  does in one process, where each reader's copy is placed from it;
* the training loss (and any output made on no rank in particular, such as an
  optimizer's step count) is sent from the process that makes it to every other
  process, so every process returns it;
* outputs (gradients, aux, results) held by another process are returned as
  global `jax.Array`s without local shards: the tree keeps its structure and
  `x.is_fully_addressable` says whether this process owns a leaf.

A rank lives in one process (its submesh's devices all belong to it); ranks may
own different numbers of devices and axes. A mesh where every device is local is
the single-process plan, untouched.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._comm import is_transfer, make_transport
from .._compile.compiler import CellSpec
from .._runtime.plan import Step
from .._runtime.slots import Activation, Cotangent, GradAccumulator, Input, InputKind, Output
from ..errors import DistributedError
from .draft import Draft
from .gradients import grad_stage
from .layout import Layout


def is_multiprocess(mesh) -> bool:
    """Whether some device of `mesh` belongs to another process."""
    me = jax.process_index()
    return any(d.process_index != me for d in mesh.devices.flat)


def rank_processes(mesh) -> tuple[int, ...]:
    """The process holding each pipeline rank; raises if a rank spans processes or a process of
    the job holds no rank. Ranks may differ in size and shape: a value crossing between processes
    whose ranks cut it differently travels in a layout both can hold (`_comm.wire`)."""
    procs = []
    for r in range(mesh.mpmd_dim):
        held = sorted({d.process_index for d in mesh.submesh(r).devices.flat})
        if len(held) != 1:
            raise DistributedError(
                f"pipeline rank {r}'s devices belong to processes {held}; a rank must live in one "
                "process. Build the mesh over jax.devices() with the pipeline axis first and a whole "
                "number of ranks per process (devices per process a multiple of devices per rank)."
            )
        procs.append(held[0])
    world = jax.process_count()
    if set(procs) != set(range(world)):
        idle = sorted(set(range(world)) - set(procs))
        raise DistributedError(
            f"the job has {world} processes but the mesh's {mesh.mpmd_dim} pipeline ranks live in "
            f"processes {sorted(set(procs))}: processes {idle} hold no rank. Start as many processes "
            f"as the mesh needs, or build the mesh over every process's devices (jax.devices())."
        )
    return tuple(procs)


def _spec_sharding(spec: CellSpec):
    for sh in (*spec.out_shardings, *(s.sharding for s in spec.in_specs)):
        if sh is not None:
            return sh
    raise DistributedError("a plan cell has no sharding to tell its rank by.")


class _Shapes:
    """The abstract value of any slot, from the step that produces it (cells traced lazily)."""

    def __init__(self):
        self.producer: dict = {}
        self._cell_outs: dict = {}

    def record(self, fn, outs) -> None:
        for k, o in enumerate(outs):
            self.producer[o] = (fn, k)

    def of(self, slot: int, ins_of: dict):
        fn, k = self.producer[slot]
        if isinstance(fn, CellSpec):
            if fn not in self._cell_outs:
                self._cell_outs[fn] = jax.eval_shape(fn.fn, *fn.in_specs)
            out = self._cell_outs[fn][k]
            return out.shape, out.dtype
        return self.of(ins_of[slot], ins_of)  # a move: the shape of what it moved


def _first_readers(draft: Draft) -> dict:
    """`{slot: (rank, cell)}`: the first scheduled cell (in issue order) whose programs read the slot."""
    readers: dict = {}
    for rank, action, first, end in sorted(draft.action_steps, key=lambda a: a[2]):
        for step in draft.steps[first:end]:
            if isinstance(step.fn, CellSpec):
                for slot in step.ins:
                    readers.setdefault(slot, (rank, action))
    return readers


class _Localizer:
    def __init__(self, draft: Draft, layout: Layout):
        self.draft, self.layout = draft, layout
        self.mesh = layout.mesh
        self.procs = rank_processes(self.mesh)
        self.me = jax.process_index()
        self.rank_of_device = {
            d: r for r in range(self.mesh.mpmd_dim) for d in self.mesh.submesh(r).devices.flat
        }
        self.names = {slot: key for key, slot in draft.named.items()}
        self.shapes = _Shapes()
        self.moved_from: dict = {}  # dst slot -> src slot, for every move
        self.readers = _first_readers(draft)

    def rank(self, sharding) -> int:
        return self.rank_of_device[next(iter(sharding.device_set))]

    def describe(self, src_slot: int, dst_slot: int, r_src: int, r_dst: int) -> str:
        """What a transfer carries and, where a scheduled cell reads it, that cell (`1F0`: stage 1's
        forward of microbatch 0), as a process waiting for it names it."""
        reader = self.readers.get(dst_slot)
        cell = f", for cell {reader[1]!r} of rank {reader[0]}" if reader else ""
        return self._carried(src_slot, dst_slot, r_src, r_dst) + cell

    def _carried(self, src_slot: int, dst_slot: int, r_src: int, r_dst: int) -> str:
        key = self.names.get(dst_slot)
        g = self.layout.graph
        if isinstance(key, Activation):
            e = g.edges[key.edge]
            return (
                f"the activation of edge {key.edge} (stage {e.src} on rank {r_src} -> stage {e.dst} "
                f"on rank {r_dst}), microbatch {key.microbatch}"
            )
        if isinstance(key, Cotangent):
            e = g.edges[key.edge]
            return (
                f"the cotangent of edge {key.edge} (stage {e.dst} on rank {r_src} -> stage {e.src} "
                f"on rank {r_dst}), microbatch {key.microbatch}"
            )
        src = self.names.get(src_slot)
        if isinstance(src, GradAccumulator):
            return (
                f"the gradient of parameter leaf {src.leaf} from stage {src.stage} (rank {r_src}), summed "
                f"on rank {r_dst}"
            )
        return f"a buffer moved from rank {r_src} to rank {r_dst}"

    def run(self, transport, keep: set) -> tuple[list, set, list]:
        steps: list = self._share_params(transport)
        for fn, ins, outs, frees in self.draft.steps:
            self.shapes.record(fn, outs)
            if isinstance(fn, CellSpec):
                if self.procs[self.rank(_spec_sharding(fn))] == self.me:
                    steps.append((fn, ins, outs, frees))
                continue
            if not is_transfer(fn):
                raise DistributedError(f"a multi-process plan cannot place the step {fn!r}.")
            self.moved_from.update(zip(outs, ins))
            steps += self._moves(transport, fn, ins, outs)
        outputs = self.draft.outputs
        if Output.LOSS in outputs:
            steps += self._broadcast(transport, outputs[Output.LOSS], copy=False)
        for slot in outputs.get(Output.REPLICATED, ()):  # the caller may donate them to the next call
            steps += self._broadcast(transport, slot, copy=True)
        made_here = {o for _, _, outs, _ in steps for o in outs}
        remote = []
        for slot in sorted(keep - made_here):
            fn, k = self.shapes.producer[slot]
            sharding = fn.out_shardings[k] if isinstance(fn, CellSpec) else fn.targets[k]
            shape, dtype = self.shapes.of(slot, self.moved_from)
            remote.append((slot, jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)))
        return steps, keep, remote

    def _moves(self, transport, fn, ins, outs) -> list:
        local, cross = [], {}
        for k, (src, dst) in enumerate(zip(fn.sources, fn.targets)):
            r_src, r_dst = self.rank(src), self.rank(dst)
            a, b = self.procs[r_src], self.procs[r_dst]
            if a == b:
                if a == self.me:
                    local.append(k)
            else:
                cross.setdefault((a, b), []).append((k, r_src, r_dst))
        steps = []
        if local:
            move = transport.local_step([fn.sources[k] for k in local], [fn.targets[k] for k in local])
            steps.append((move, tuple(ins[k] for k in local), tuple(outs[k] for k in local), ()))
        for (a, b), moves in sorted(cross.items()):  # every process allocates every group, in order
            what = "; ".join(self.describe(ins[k], outs[k], rs, rd) for k, rs, rd in moves)
            group = transport.new_group(what, a)
            idx = [k for k, _, _ in moves]
            if self.me not in (a, b):
                continue
            sources = [fn.sources[k] for k in idx]
            specs = [
                jax.ShapeDtypeStruct(*self.shapes.of(ins[k], self.moved_from), sharding=fn.targets[k])
                for k in idx
            ]
            if a == self.me:
                step = transport.send_step(group, b, sources, specs)
                steps.append((step, tuple(ins[k] for k in idx), (), ()))
            else:
                step = transport.recv_step(group, a, sources, specs)
                steps.append((step, (), tuple(outs[k] for k in idx), ()))
        return steps

    def _share_params(self, transport) -> list:
        """Steps sending each parameter leaf read on a rank of another process than its owner's
        (`grad_stage`) from the owner's rank to that reader, one group per pair of processes; the
        keys received here go in `draft.received` (filled by the plan, not placed by the call)."""
        steps = []
        for (a, b), reads in sorted(self._cross_reads().items()):  # every process, in order
            what = "; ".join(f"parameter leaf {k.leaf} (rank {o} -> rank {k.rank})" for _, o, k in reads)
            group = transport.new_group(what, a)
            sources = [self._param_sharding(k.leaf, o) for _, o, k in reads]
            avals = [self.layout.graph.in_avals[k.leaf] for _, _, k in reads]
            specs = [
                jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self._param_sharding(k.leaf, k.rank))
                for v, (_, _, k) in zip(avals, reads)
            ]
            if self.me == a:  # a copy is sent: the call may consume the owner's buffer (donation)
                held = tuple(
                    jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s) for v, s in zip(avals, sources)
                )
                sent = tuple(self.draft.new() for _ in reads)
                steps.append((CellSpec(_copy, held, tuple(sources)), tuple(o for o, _, _ in reads), sent, ()))
                steps.append((transport.send_step(group, b, sources, specs), sent, (), ()))
            elif self.me == b:
                received = tuple(self.draft.named[k] for _, _, k in reads)
                steps.append((transport.recv_step(group, a, sources, specs), (), received, ()))
                self.draft.received.update(k for _, _, k in reads)
        return steps

    def _cross_reads(self) -> dict:
        """`{(owner's process, reader's process): [(owner's input slot, owner rank, reader's key)]}`
        of the parameter leaves read on ranks of another process than their owner's."""
        cross: dict = {}
        for key in self.draft.named:
            if not isinstance(key, Input) or key.kind != InputKind.PARAM:
                continue
            owner = self.layout.ranks[grad_stage(self.layout, key.leaf)]
            if self.procs[owner] != self.procs[key.rank]:
                own = self.draft.named[Input(InputKind.PARAM, key.leaf, owner)]
                cross.setdefault((self.procs[owner], self.procs[key.rank]), []).append((own, owner, key))
        return cross

    def _param_sharding(self, a: int, rank: int) -> NamedSharding:
        return self.layout.on_rank(rank, self.layout.param_spec(a, rank))

    def _broadcast(self, transport, slot: int, copy: bool) -> list:
        """Steps sending output `slot` from the process that makes it to every other process,
        each receiving it replicated on its first rank's submesh. With `copy`, a copy is sent, so
        the caller may donate the output while the transfer is in flight."""
        if slot in self.draft.constants:
            value, source = self.draft.constants[slot]
            shape, dtype = np.shape(value), np.asarray(value).dtype
        else:
            fn, k = self.shapes.producer[slot]
            source = fn.out_shardings[k] if isinstance(fn, CellSpec) else fn.targets[k]
            shape, dtype = self.shapes.of(slot, self.moved_from)
        rank = self.rank(source)
        owner = self.procs[rank]
        steps = []
        if copy and self.me == owner and jax.process_count() > 1:
            sent = self.draft.new()
            spec = CellSpec(_copy, (jax.ShapeDtypeStruct(shape, dtype, sharding=source),), (source,))
            steps.append((spec, (slot,), (sent,), ()))
            slot = sent
        for p in range(jax.process_count()):
            if p == owner:
                continue
            group = transport.new_group(f"output buffer {slot} (rank {rank} -> process {p})", owner)
            home = self.mesh.submesh(self.procs.index(p))
            spec = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(home, PartitionSpec()))
            if self.me == owner:
                steps.append((transport.send_step(group, p, [source], [spec]), (slot,), (), ()))
            elif self.me == p:
                steps.append((transport.recv_step(group, owner, [source], [spec]), (), (slot,), ()))
        return steps


def _copy(*xs):
    return xs  # a compiled identity makes new buffers


def localize(draft: Draft, layout: Layout, compiler, keep: set) -> set:
    """Rewrite `draft`'s steps (and its constants) to this process's share of a multi-process
    plan, and record the transport, local ranks and remote outputs. A no-op (returns `keep`)
    when every device of the mesh is local."""
    if not is_multiprocess(layout.mesh):
        return keep
    loc = _Localizer(draft, layout)
    if compiler.transport is None:
        compiler.transport = make_transport()
    steps, keep, remote = loc.run(compiler.transport, keep)
    draft.steps = [Step(*step) for step in steps]
    draft.constants = {
        slot: (value, sh)
        for slot, (value, sh) in draft.constants.items()
        if loc.procs[loc.rank(sh)] == loc.me
    }
    draft.transport = compiler.transport
    draft.local_ranks = frozenset(r for r, p in enumerate(loc.procs) if p == loc.me)
    draft.remote_outputs = remote
    return keep
