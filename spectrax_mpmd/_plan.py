"""Compile a stage graph into a flat plan: per-rank executables wired by integer slots.

A plan is a list of steps `(callable, input slots, output slots, slots to free)`.
Running it is a tight loop over a list of buffers; all pytree work, sharding
decisions, compilation and dependency ordering happen here, once per signature.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._cells import StageCells, StageIO
from ._comm import is_transfer, transfer
from ._compile import CellSpec, Compiler, _sds
from ._mesh import MpmdMesh
from ._multihost import localize
from ._order import order_actions
from ._split import StageGraph
from .errors import MpmdError, StageSplitError

REPLICATED = PartitionSpec()


@dataclass
class Plan:
    """A compiled, ordered program for one call signature."""

    steps: list = field(default_factory=list)
    log: list = field(default_factory=list)
    n_slots: int = 0
    const_slots: dict = field(default_factory=dict)
    input_keys: list = field(default_factory=list)
    input_shardings: list = field(default_factory=list)
    output_slots: dict = field(default_factory=dict)
    stage_ranks: tuple = ()
    cells: dict = field(default_factory=dict)
    activation_slots: dict = field(default_factory=dict)
    forward_steps: dict = field(default_factory=dict)
    action_steps: list = field(default_factory=list)  # (rank, action, first step, end step)
    device_rank: dict = field(default_factory=dict)  # device -> pipeline rank
    graph: object = None  # the StageGraph the plan runs
    saved: dict = field(default_factory=dict)  # (stage, kind) -> trailing outputs kept per microbatch
    ran: frozenset = frozenset()  # the (stage, kind) cells the plan runs, alone or fused
    schedule: object = None  # the schedule it runs (regions merged into one)
    slot_names: dict = field(default_factory=dict)  # slot -> the builder's key for it (last alias wins)
    # multi-process only (`_multihost`): the cross-process transport, the ranks this process
    # runs (None: all), and (slot, global array without local shards) of outputs held elsewhere
    transport: object = None
    local_ranks: frozenset | None = None
    remote_outputs: list = field(default_factory=list)

    def _buffers(self, placed_inputs: Sequence) -> list:
        buf: list = [None] * self.n_slots
        for slot, value in self.const_slots.items():
            buf[slot] = value
        for (slot, _), value in zip(self.input_keys, placed_inputs):
            buf[slot] = value
        return buf

    def run(self, placed_inputs: Sequence) -> list:
        """Run every step; `placed_inputs` are aligned with `input_keys`. Returns the buffers."""
        if self.transport is not None:
            self.transport.begin()
        buf = self._buffers(placed_inputs)
        for fn, ins, outs, frees in self.steps:
            results = fn(*[buf[i] for i in ins])
            for o, r in zip(outs, results):
                buf[o] = r
            for f in frees:
                buf[f] = None
        if self.transport is not None:
            self.transport.end()  # waits for this call's cross-process receives, up to the timeout
            for slot, value in self.remote_outputs:
                buf[slot] = value
        return buf

    def check_single_process(self, what: str) -> None:
        """Refuse a diagnostic that walks the steps itself: in a multi-process plan the steps are
        this process's share, and their transfers pair up only inside `run`."""
        if self.transport is not None:
            raise MpmdError(
                f"{what} runs the plan step by step in one process; in a multi-process run it is not "
                "available. Profile the same model in one process (a mesh over local devices)."
            )

    def with_public_transfers(self) -> "Plan":
        """This plan with every transfer through the public `jax.device_put` (for checking the
        fast path: both must give the same values on the same shardings)."""
        steps = [
            (fn.public() if is_transfer(fn) else fn, ins, outs, frees) for fn, ins, outs, frees in self.steps
        ]
        return dataclasses.replace(self, steps=steps)

    def timeline(self, placed_inputs: Sequence) -> list[tuple[int, object, float, float]]:
        """Run once, each step alone (waiting for its results), and return per action
        `(rank, action, start, end)` in seconds from the first step: the cell and the
        sends that follow it. Slower than `run`; for inspecting where a step's time goes."""
        self.check_single_process("timeline")
        buf = jax.block_until_ready(self._buffers(placed_inputs))
        owner = {k: j for j, (_, _, a, b) in enumerate(self.action_steps) for k in range(a, b)}
        spans: dict[int, list[float]] = {}
        t0 = time.perf_counter()
        for k, (fn, ins, outs, frees) in enumerate(self.steps):
            start = time.perf_counter()
            results = jax.block_until_ready(fn(*[buf[i] for i in ins]))
            end = time.perf_counter()
            for o, r in zip(outs, results):
                buf[o] = r
            for f in frees:
                buf[f] = None
            if k in owner:
                span = spans.setdefault(owner[k], [start - t0, end - t0])
                span[1] = end - t0
        return [(*self.action_steps[j][:2], *spans[j]) for j in sorted(spans)]

    def peak_activations(self, placed_inputs: Sequence) -> list[int]:
        """Run once, counting per rank the `(stage, microbatch)` pairs whose activation buffers
        are alive after each step; returns the peaks. Counted buffers: saved residuals and the
        I/W stash, or with `remat=True` the stage inputs kept for the backward — from the
        forward that consumes them on (a received input waiting for its forward is not counted)."""
        self.check_single_process("peak_activations")
        buf = self._buffers(placed_inputs)
        ranks = 1 + max(self.stage_ranks)
        peak = [0] * ranks
        started: set = set()
        for k, (fn, ins, outs, frees) in enumerate(self.steps):
            results = fn(*[buf[i] for i in ins])
            for o, r in zip(outs, results):
                buf[o] = r
            started.update(self.forward_steps.get(k, ()))
            live: set = {
                owner
                for slot, owner in self.activation_slots.items()
                if buf[slot] is not None and owner[1:] in started
            }
            for f in frees:
                buf[f] = None
            for r in range(ranks):
                peak[r] = max(peak[r], sum(1 for owner in live if owner[0] == r))
        return peak


@dataclass
class _Slots:
    count: int = 0
    named: dict = field(default_factory=dict)

    def new(self) -> int:
        self.count += 1
        return self.count - 1

    def __getitem__(self, key) -> int:
        if key not in self.named:
            self.named[key] = self.new()
        return self.named[key]

    def alias(self, key, slot: int) -> None:
        self.named[key] = slot


def _free_after_last_use(steps: list, keep: set[int]) -> list:
    last: dict[int, int] = {}
    for k, (_, ins, outs, _) in enumerate(steps):
        for i in (*ins, *outs):
            last[i] = k
    frees: dict[int, list[int]] = {}
    for slot, k in last.items():
        if slot not in keep:
            frees.setdefault(k, []).append(slot)
    return [
        (fn, tuple(ins), tuple(outs), tuple(frees.get(k, ()))) for k, (fn, ins, outs, _) in enumerate(steps)
    ]


class TrainPlanBuilder:
    """Builds the plan of one training step (`sxvalue_and_grad`)."""

    def __init__(
        self,
        graph: StageGraph,
        schedule,
        mesh: MpmdMesh,
        *,
        diff_args: Sequence[int],
        batch_args: Sequence[int],
        batch_avals: dict,
        param_specs: dict,
        remat: bool,
        compiler: Compiler,
        keys: frozenset = frozenset(),
        reduce: str = "mean",
        require_loss: bool = True,
    ):
        self.g, self.schedule, self.mesh = graph, schedule, mesh
        self.n = mesh.mpmd_dim
        self.m = schedule.microbatches
        self.diff_args, self.batch_args = tuple(diff_args), tuple(batch_args)
        self.batch_avals, self.param_specs = batch_avals, param_specs
        self.remat, self.compiler, self.reduce = remat, compiler, reduce
        self.last = len(graph.stages) - 1
        self.rank = tuple(schedule.rank_of(s, self.n) for s in range(len(graph.stages)))
        self.slots = _Slots()
        self.steps: list = []
        self._forward_specs: dict = {}
        self._fused: dict = {}
        self._constants: dict = {}  # slot -> (host value, sharding), placed together when sealed
        self.forward_steps: dict = {}
        self.plan = Plan(stage_ranks=self.rank, schedule=schedule)
        self.ios = [
            StageIO.build(
                graph,
                s,
                set(diff_args),
                set(batch_args),
                loss=(s == self.last),
                microbatches=self.m,
                keys=keys,
            )
            for s in range(len(graph.stages))
        ]
        self.splits = (
            any(p.kind in ("I", "W") for rank in schedule.actions(self.n) for a in rank for p in a.parts)
            if hasattr(schedule, "actions")
            else False
        )
        self.unsharded = not any(spec is not None for spec in param_specs.values()) and all(
            e.spec is None for e in graph.edges
        )
        if require_loss and 0 not in graph.stages[self.last].results:
            raise StageSplitError(
                "the loss (the function's first output) must be computed in the last stage; it is "
                f"computed in stage {graph.result_stage[0]}. Move the loss after the last sxstage_iter."
            )

    # -- shardings -----------------------------------------------------------------------
    def sub(self, s: int):
        return self.mesh.submesh(self.rank[s])

    def named(self, s: int, spec) -> NamedSharding:
        return NamedSharding(self.sub(s), spec if spec is not None else REPLICATED)

    def param_sharding(self, a: int, s: int) -> NamedSharding:
        return self.named(s, self.param_specs.get(a))

    def out_sharding(self, var, s: int) -> NamedSharding:
        edges = [e for e in self.g.edges if e.var is var and e.src == s]
        same_rank = [e for e in edges if self.rank[e.dst] == self.rank[s]]
        return self.named(s, (same_rank or edges)[0].spec)

    def edge_sharding(self, e) -> NamedSharding:
        return self.named(e.dst, e.spec)

    # -- slots of inputs ---------------------------------------------------------------
    def input_slots(self, s: int) -> list[int]:
        io, r = self.ios[s], self.rank[s]
        return (
            [self.slots["param", a, r] for a in io.params]
            + [self.slots["fixed", a, r] for a in io.fixed]
            + [self.slots["batch", a, r] for a in io.batch]
        )

    def input_specs(self, s: int) -> list:
        io, avals = self.ios[s], self.g.in_avals
        specs = [_sds(avals[a], self.param_sharding(a, s)) for a in io.params]
        specs += [_sds(avals[a], self.named(s, None)) for a in io.fixed]
        specs += [_sds(self.batch_avals[a], self.named(s, None)) for a in io.batch]
        specs.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=self.named(s, None)))
        specs += [_sds(e.aval, self.edge_sharding(e)) for e in io.stage.edge_inputs]
        return specs

    def cell_inputs(self, s: int, i: int) -> list[int]:
        """Slots of stage `s`'s inputs for microbatch `i`, in the cells' argument order."""
        edges = [self.slots["edge", self.edge_index[e], i] for e in self.ios[s].stage.edge_inputs]
        return self.input_slots(s) + [self.idx_slot(s, i)] + edges

    def idx_slot(self, s: int, i: int) -> int:
        key = ("idx", self.rank[s], i)
        if key not in self.slots.named:
            slot = self.slots[key]
            self._constants[slot] = (np.int32(i), self.named(s, None))
        return self.slots[key]

    # -- build ---------------------------------------------------------------------------
    def build(self) -> Plan:
        self.cells = [
            StageCells(io, self.m, self.remat, self.input_specs(s), self.reduce)
            for s, io in enumerate(self.ios)
        ]
        self.edge_index = {e: k for k, e in enumerate(self.g.edges)}
        self._compile_cells()
        self._init_accumulators()
        for rank, action in order_actions(self.schedule, self.n, self.g):
            start = len(self.steps)
            names = [self._emit(p) for p in action.parts]
            if len(action.parts) > 1:
                self._fuse_cells(start)
            forwards = [(p.stage, p.microbatch) for p in action.parts if p.kind == "F"]
            if forwards:
                self.forward_steps[start] = forwards
            self.plan.log.append((rank, action, "&".join(n for n in names if n != "-") or "-"))
            self.plan.action_steps.append((rank, action, start, len(self.steps)))
        self._finish()
        return self.plan

    def _compile_cells(self) -> None:
        # programs that need no other program's output info compile together first
        independent = [self._forward_spec(s) for s in range(self.last)]
        independent += [spec for spec, _ in self._accumulator_cells]
        if not all(self._free_sharding(s) is not None for s in range(len(self.ios))):
            self.compiler.prefetch([*independent, self._loss_spec])
        self.exe: list[dict] = []
        for s, (io, cells) in enumerate(zip(self.ios, self.cells)):
            specs = self.input_specs(s)
            acc_sh = [self.param_sharding(a, s) for a in io.params]
            acc_specs = [_sds(self.acc_aval(a), sh) for a, sh in zip(io.params, acc_sh)]
            ct_in_sh = [self.edge_sharding(io.stage.edge_inputs[k]) for k in io.diff_in]
            results_sh = [self.named(s, None)] * len(io.stage.results)
            exe = {}
            if s == self.last:
                exe["FB"] = self._loss_spec
                self.exe.append(exe)
                continue
            n_fwd_out = len(io.stage.edge_outputs) + len(results_sh)
            exe["F"] = self._forward_spec(s)
            if self.remat or not cells.produced_residual_avals:
                produced = []
            elif self._free_sharding(s) is not None:
                produced = [_sds(a, self._free_sharding(s)) for a in cells.produced_residual_avals]
            else:
                produced = [
                    jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding)
                    for o in self.compiler.compile_spec(exe["F"]).out_info[n_fwd_out:]
                ]
            exe["n_res"] = len(produced)
            made = iter(produced)
            res_specs = [specs[src] if src is not None else next(made) for src in cells.residual_sources]
            ct_specs = [
                _sds(io.stage.edge_outputs[j].aval, self.out_sharding(io.stage.edge_outputs[j], s))
                for j, consumers in zip(io.diff_out, io.ct_edges)
                for _ in consumers
            ]
            exe["B"] = CellSpec(
                cells.backward,
                tuple(res_specs + ct_specs + acc_specs),
                (*acc_sh, *ct_in_sh),
                tuple(range(len(res_specs) + len(ct_specs), len(res_specs) + len(ct_specs) + len(acc_specs))),
            )
            if self.splits:
                i_fn, w_fn, n_stash = cells.split_backward()
                free = self._free_sharding(s)
                exe["I"] = CellSpec(i_fn, tuple(res_specs + ct_specs), (*ct_in_sh, *[free] * n_stash))
                if free is not None:
                    shapes = jax.eval_shape(i_fn, *res_specs, *ct_specs)[len(ct_in_sh) :]
                    stash_specs = [_sds(a, free) for a in shapes]
                else:
                    stash_specs = [
                        jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding)
                        for o in self.compiler.compile_spec(exe["I"]).out_info[len(ct_in_sh) :]
                    ]
                n_w_in = len(res_specs) + len(ct_specs) + n_stash
                exe["W"] = CellSpec(
                    w_fn,
                    tuple(res_specs + ct_specs + stash_specs + acc_specs),
                    tuple(acc_sh),
                    tuple(range(n_w_in, n_w_in + len(acc_specs))),
                )
                exe["n_stash"] = n_stash
            self.exe.append(exe)

    def _forward_spec(self, s: int, *, keep_residuals: bool = True, donate: tuple = ()) -> CellSpec:
        """Stage `s`'s forward: edge outputs, results, and (unless remat) the saved residuals."""
        key = (s, keep_residuals, donate)
        if key not in self._forward_specs:
            self._forward_specs[key] = self._new_forward_spec(s, keep_residuals, donate)
        return self._forward_specs[key]

    def _new_forward_spec(self, s: int, keep_residuals: bool, donate: tuple) -> CellSpec:
        io, cells = self.ios[s], self.cells[s]
        residuals = keep_residuals and not self.remat
        outs = [self.out_sharding(v, s) for v in io.stage.edge_outputs]
        outs += [self.named(s, None)] * len(io.stage.results)
        if residuals:
            outs += [self._free_sharding(s)] * len(cells.produced_residual_avals)
        return CellSpec(
            cells.forward if residuals else cells.forward_only,
            tuple(self.input_specs(s)),
            tuple(outs),
            donate,
        )

    def _free_sharding(self, s: int) -> NamedSharding | None:
        """The sharding of stage `s`'s residuals and stash, when it is known before compiling.

        On a one-device submesh, or when nothing in the pipeline is sharded, every
        intermediate is replicated, so backward cells can be compiled alongside the
        forward ones; otherwise (None) XLA picks and the forward is compiled first.
        """
        return self.named(s, None) if self.unsharded or self.sub(s).size == 1 else None

    @functools.cached_property
    def _loss_spec(self) -> CellSpec:
        """The last stage's fused value-and-grad cell."""
        s, io = self.last, self.ios[self.last]
        specs = self.input_specs(s)
        acc_sh = [self.param_sharding(a, s) for a in io.params]
        acc_specs = [_sds(self.acc_aval(a), sh) for a, sh in zip(io.params, acc_sh)]
        ct_in_sh = [self.edge_sharding(io.stage.edge_inputs[k]) for k in io.diff_in]
        results_sh = [self.named(s, None)] * (len(io.stage.results) - 1)
        loss_spec = _sds(self.acc_aval("loss"), self.named(s, None))
        n_in = len(specs)
        return CellSpec(
            self.cells[s].loss_step,
            tuple(specs + acc_specs + [loss_spec]),
            (*acc_sh, *ct_in_sh, self.named(s, None), *results_sh),
            tuple(range(n_in, n_in + len(acc_specs) + 1)),
        )

    def _fuse_cells(self, start: int) -> None:
        """Merge the cell steps emitted since `start` into one executable; transfers follow it."""
        new = self.steps[start:]
        cells = [st for st in new if isinstance(st[0], CellSpec)]
        if len(cells) < 2:
            return
        parts = tuple(st[0] for st in cells)
        if parts not in self._fused:  # one fused spec per combination of cells, reused per microbatch
            spec = parts[0]
            for other in parts[1:]:
                spec = spec.fuse(other)
            self._fused[parts] = spec
        spec = self._fused[parts]
        ins = [i for st in cells for i in st[1]]
        outs = [o for st in cells for o in st[2]]
        rest = [st for st in new if not isinstance(st[0], CellSpec)]
        self.steps[start:] = [(spec, tuple(ins), tuple(outs), ())] + rest

    def acc_aval(self, a):
        """The accumulator of parameter leaf `a` (or of the loss): float32 for 16-bit floats, so
        summing microbatches adds no rounding beyond the reference's; cast back at the end."""
        aval = self.g.out_avals[0] if a == "loss" else self.g.in_avals[a]
        if jnp.dtype(aval.dtype).itemsize < 4 and jnp.issubdtype(aval.dtype, jnp.floating):
            return aval.update(dtype=jnp.float32)
        return aval

    def _cast_back(self, slot: int, acc, aval, sharding) -> int:
        """A step casting an accumulator to its parameter's (or the loss's) dtype, if they differ."""
        if acc.dtype == aval.dtype:
            return slot
        out = self.slots.new()
        cast = CellSpec(_caster(aval.dtype), (_sds(acc, sharding),), (sharding,))
        self.steps.append((cast, (slot,), (out,), ()))
        return out

    @functools.cached_property
    def _accumulator_cells(self) -> list[tuple[CellSpec, tuple[int, ...]]]:
        """One program per rank creating the zero gradient (and loss) accumulators of its stages.

        A parameter leaf that no stage reads gets its zero gradient here too, on the
        first stage's rank: a fresh array every call, so donating it is safe.
        """
        per_rank: dict[int, tuple[list, list, list]] = {}
        read = {a for io in self.ios for a in io.params}
        unused = [a for a in self.diff_args if a not in read]
        if unused:
            shardings, avals, outs = per_rank.setdefault(self.rank[0], ([], [], []))
            shardings += [self.param_sharding(a, 0) for a in unused]
            avals += [self.g.in_avals[a] for a in unused]
            outs += [self.slots["zero_grad", a] for a in unused]
        for s, io in enumerate(self.ios):
            shardings, avals, outs = per_rank.setdefault(self.rank[s], ([], [], []))
            shardings += [self.param_sharding(a, s) for a in io.params]
            avals += [self.acc_aval(a) for a in io.params]
            outs += [self.slots["acc", s, a] for a in io.params]
            if s == self.last:
                shardings.append(self.named(s, None))
                avals.append(self.acc_aval("loss"))
                outs.append(self.slots["loss"])
        cells = []
        for rank, (shardings, avals, outs) in sorted(per_rank.items()):
            if not outs:
                continue

            def zeros(avals=tuple(avals)):
                return tuple(jnp.zeros(v.shape, v.dtype) for v in avals)

            cells.append((CellSpec(zeros, (), tuple(shardings)), tuple(outs)))
        return cells

    def _init_accumulators(self) -> None:
        for spec, outs in self._accumulator_cells:
            self.steps.append((spec, (), outs, ()))

    def _transfer(self, pairs: list[tuple]) -> None:
        """Move `(src slot, dst slot key, dst sharding, src sharding)` values; a move to the same
        sharding becomes an alias of the source slot."""
        moves = []
        for src, dst_key, sharding, src_sharding in pairs:
            if sharding == src_sharding:
                self.slots.alias(dst_key, src)
            else:
                moves.append((src, self.slots[dst_key], sharding, src_sharding))
        if moves:
            self.steps.append(
                (
                    transfer([m[3] for m in moves], [m[2] for m in moves]),
                    tuple(m[0] for m in moves),
                    tuple(m[1] for m in moves),
                    (),
                )
            )

    def _emit(self, a) -> str:
        s, i, kind = a.stage, a.microbatch, a.kind
        io = self.ios[s]
        if s == self.last:
            if kind == "F":
                self._emit_loss_step(s, i)
                return "FB"
            return "-"
        exe = self.exe[s]
        if kind == "F":
            self._emit_forward(exe["F"], s, i, exe["n_res"])
            return "F"
        res = self.residual_slots(s, i)
        cts = [self.slots["ct", k, i] for group in io.ct_edges for k in group]
        acc = [self.slots["acc", s, a_] for a_ in io.params]
        ct_out = [self.slots["ct_in", self.edge_index[io.stage.edge_inputs[k]], i] for k in io.diff_in]
        if kind == "B":
            self.steps.append((exe["B"], tuple(res + cts + acc), tuple(acc + ct_out), ()))
            self._send_cts(s, i)
            return "B"
        if kind == "I":
            stash = [self.slots["stash", s, i, k] for k in range(exe["n_stash"])]
            if ct_out or stash:  # an I cell with nothing to return (first stage, no stash) is skipped
                self.steps.append((exe["I"], tuple(res + cts), tuple(ct_out + stash), ()))
            self._send_cts(s, i)
            return "I"
        stash = [self.slots["stash", s, i, k] for k in range(exe["n_stash"])]
        self.steps.append((exe["W"], tuple(res + cts + stash + acc), tuple(acc), ()))
        return "W"

    def residual_slots(self, s: int, i: int) -> list[int]:
        """The slots of stage `s`'s residuals for microbatch `i`, in the backward's order: inputs
        the backward reads as they are, then what the forward computed."""
        ins, made = self.cell_inputs(s, i), iter(range(self.exe[s]["n_res"]))
        return [
            ins[src] if src is not None else self.slots["res", s, i, next(made)]
            for src in self.cells[s].residual_sources
        ]

    def _emit_forward(self, cell, s: int, i: int, n_res: int) -> list[int]:
        """A forward step of stage `s` on microbatch `i`, then the sends of its outputs."""
        io = self.ios[s]
        outs = [self.slots["out", s, j, i] for j in range(len(io.stage.edge_outputs))]
        results = [self.slots["result", j, i] for j in io.stage.results]
        res = [self.slots["res", s, i, k] for k in range(n_res)]
        self.steps.append((cell, tuple(self.cell_inputs(s, i)), tuple(outs + results + res), ()))
        pairs = [
            (outs[j], ("edge", self.edge_index[e], i), self.edge_sharding(e), self.out_sharding(v, s))
            for j, v in enumerate(io.stage.edge_outputs)
            for e in self.g.consumers(s)[v]
        ]
        self._transfer(pairs)
        return results

    def _emit_loss_step(self, s: int, i: int) -> None:
        io = self.ios[s]
        ins = self.cell_inputs(s, i)
        acc = [self.slots["acc", s, a] for a in io.params]
        ct_out = [self.slots["ct_in", self.edge_index[io.stage.edge_inputs[k]], i] for k in io.diff_in]
        results = [self.slots["result", j, i] for j in io.stage.results if j != 0]
        loss = self.slots["loss"]
        self.steps.append(
            (self.exe[s]["FB"], tuple(ins + acc + [loss]), tuple(acc + ct_out + [loss] + results), ())
        )
        self._send_cts(s, i)

    def _send_cts(self, s: int, i: int) -> None:
        io = self.ios[s]
        pairs = []
        for k in io.diff_in:
            e = io.stage.edge_inputs[k]
            ek = self.edge_index[e]
            pairs.append(
                (
                    self.slots["ct_in", ek, i],
                    ("ct", ek, i),
                    self.out_sharding(e.var, e.src),
                    self.edge_sharding(e),
                )
            )
        self._transfer(pairs)

    def _finish(self) -> None:
        """Sum gradients of shared parameters on their owner, stack per-microbatch results."""
        users: dict[int, list[int]] = {}
        for s, io in enumerate(self.ios):
            for a in io.params:
                users.setdefault(a, []).append(s)
        grads = {a: self.slots["zero_grad", a] for a in self.diff_args if a not in users}
        for a, stages in users.items():
            owner = stages[0]
            slot = self.slots["acc", owner, a]
            for s in stages[1:]:
                sh = self.param_sharding(a, owner)
                moved = self.slots.new()
                if self.param_sharding(a, s) != sh:
                    move = transfer([self.param_sharding(a, s)], [sh])
                    self.steps.append((move, (self.slots["acc", s, a],), (moved,), ()))
                else:
                    moved = self.slots["acc", s, a]
                total = self.slots.new()
                add = CellSpec(_add, (_sds(self.acc_aval(a), sh),) * 2, (sh,), (0,))
                self.steps.append((add, (slot, moved), (total,), ()))
                slot = total
            grads[a] = self._cast_back(
                slot, self.acc_aval(a), self.g.in_avals[a], self.param_sharding(a, stages[0])
            )
        loss_slot = self._cast_back(
            self.slots["loss"], self.acc_aval("loss"), self.g.out_avals[0], self.named(self.last, None)
        )
        stacked = {}
        for j in range(1, len(self.g.out_avals)):
            s = self.g.result_stage[j]
            aval = self.g.out_avals[j]
            sh = self.named(s, None)
            stack = CellSpec(_stack, (_sds(aval, sh),) * self.m, (sh,))
            stacked[j] = self.slots.new()
            self.steps.append(
                (stack, tuple(self.slots["result", j, i] for i in range(self.m)), (stacked[j],), ())
            )
        self.plan.output_slots = {"loss": loss_slot, "grads": grads, "aux": stacked}
        for key, slot in self.slots.named.items():
            if key[0] in ("res", "stash"):
                self.plan.activation_slots[slot] = (self.rank[key[1]], key[1], key[2])
            elif key[0] == "edge" and self._edge_is_residual(self.g.edges[key[1]]):
                e = self.g.edges[key[1]]
                self.plan.activation_slots.setdefault(slot, (self.rank[e.dst], e.dst, key[2]))
        self._seal({loss_slot, *grads.values(), *stacked.values()})
        self.plan.slot_names = {slot: key for key, slot in self.slots.named.items()}
        self.plan.forward_steps = self.forward_steps
        self.plan.cells = {
            (s, kind): spec
            for s, exe in enumerate(self.exe)
            for kind, spec in exe.items()
            if isinstance(spec, CellSpec)
        }
        emitted = {st[0] for st in self.steps if isinstance(st[0], CellSpec)}
        emitted.update(part for parts in self._fused for part in parts)
        self.plan.ran = frozenset(key for key, spec in self.plan.cells.items() if spec in emitted)
        self.plan.saved = {
            (s, kind): exe[count]
            for s, exe in enumerate(self.exe)
            for kind, count in (("F", "n_res"), ("I", "n_stash"))
            if kind in exe
        }

    def _edge_is_residual(self, e) -> bool:
        """Whether the activation `e` brings to its stage is kept for that stage's backward."""
        if e.dst == self.last:
            return False
        io = self.ios[e.dst]
        position = io.n_in - len(io.stage.edge_inputs) + io.stage.edge_inputs.index(e)
        return position in self.cells[e.dst].residual_sources

    def _seal(self, keep: set[int]) -> None:
        """Compile every cell, record the input slots and their shardings, free slots after last use."""
        keep = localize(self, keep)  # multi-process: only this process's ranks from here on
        local = self.plan.local_ranks
        self.plan.input_keys = [
            (slot, key)
            for key, slot in self.slots.named.items()
            if key[0] in ("param", "fixed", "batch") and (local is None or key[2] in local)
        ]
        self.plan.input_shardings = [
            NamedSharding(
                self.mesh.submesh(r), (self.param_specs.get(a) if kind == "param" else None) or REPLICATED
            )
            for _, (kind, a, r) in self.plan.input_keys
        ]
        self.compiler.prefetch([st[0] for st in self.steps if isinstance(st[0], CellSpec)])
        if self._constants:
            values, shardings = zip(*self._constants.values())
            self.plan.const_slots = dict(zip(self._constants, jax.device_put(list(values), list(shardings))))
        steps = [
            (self.compiler.compile_spec(fn) if isinstance(fn, CellSpec) else fn, ins, outs, frees)
            for fn, ins, outs, frees in self.steps
        ]
        self.plan.steps = _free_after_last_use(steps, keep)
        self.plan.n_slots = self.slots.count
        self.plan.device_rank = {d: r for r in range(self.n) for d in self.mesh.submesh(r).devices.flat}
        self.plan.graph = self.g


def _add(x, y):
    return (x + y,)


def _stack(*xs):
    return (jnp.stack(xs),)


def _caster(dtype):
    def cast(x):
        return (x.astype(dtype),)

    return cast
