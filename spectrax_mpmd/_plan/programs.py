"""Each stage's cell programs as specs: forward, backward (or its I and W halves), and the
last stage's fused value-and-grad, with the shardings of everything they read and make.

Specs are built, not compiled, here (the compiler compiles them together when the
plan is sealed); a spec whose output shardings XLA must choose (a sharded
submesh) is compiled early so the specs that read its outputs can name them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from .._compile.compiler import CellSpec, Compiler, shape_spec
from .._runtime.slots import CellKind
from .._trace.cells import StageCells, StageIO
from .._trace.policy import HOST, NO_OFFLOAD, Offload, offloaded, saved_bytes
from .layout import Layout, PlanArgs


@dataclass(frozen=True)
class StageProgram:
    """One stage's input/output map, cell functions and cell specs by kind (`F`, `B`, `I`,
    `W`; the last stage's `FB`), with how many residuals its forward saves and how many
    values its I cell stashes per microbatch, their specs, and which of them live in host
    memory between their cell and their reader (positions among `res_specs`, `stash_specs`).
    Made without specs (`programs_of`); `backward_specs` and `with_loss_spec` return it with
    them. `forwards` memoizes the forward specs by their options."""

    io: StageIO
    cells: StageCells
    in_specs: list
    specs: dict = field(default_factory=dict)
    n_res: int = 0
    n_stash: int = 0
    forwards: dict = field(default_factory=dict)  # (keep residuals, donated positions) -> spec
    offload: Offload = NO_OFFLOAD
    res_specs: list = field(default_factory=list)  # the residuals the forward returns
    stash_specs: list = field(default_factory=list)
    offload_res: tuple = ()
    offload_stash: tuple = ()
    reload: dict = field(default_factory=dict)  # cell kind -> offloaded residuals it copies back


def stage_ios(layout: Layout, args: PlanArgs, m: int) -> list[StageIO]:
    graph = layout.graph
    return [
        StageIO.build(
            graph,
            s,
            set(args.params),
            set(args.batch),
            loss=layout.is_loss(s),
            microbatches=m,
            keys=args.keys,
        )
        for s in range(len(graph.stages))
    ]


def input_specs(layout: Layout, io: StageIO, s: int, args: PlanArgs) -> list:
    """Stage `s`'s cell inputs in order: parameters, broadcast and batch leaves, the microbatch
    index, and the edges it receives."""
    avals = layout.graph.in_avals
    specs = [shape_spec(avals[a], layout.param(a, s)) for a in io.params]
    specs += [shape_spec(avals[a], layout.named(s, None)) for a in io.fixed]
    specs += [shape_spec(args.batch_avals[a], layout.named(s, None)) for a in io.batch]
    specs.append(jax.ShapeDtypeStruct((), jnp.int32, sharding=layout.named(s, None)))
    specs += [shape_spec(e.aval, layout.edge(e)) for e in io.stage.edge_inputs]
    return specs


def programs_of(layout: Layout, args: PlanArgs, m: int, remat) -> list[StageProgram]:
    """Every stage's program record, no cell spec built yet. `remat` and `args.offload` are one
    value for every stage or a tuple with one per model stage."""
    programs = []
    for s, io in enumerate(stage_ios(layout, args, m)):
        specs = input_specs(layout, io, s, args)
        model = layout.model[s]
        cells = StageCells(io, m, remat[model] if isinstance(remat, tuple) else remat, specs, args.weights)
        offload = args.offload[model] if args.offload else NO_OFFLOAD
        programs.append(StageProgram(io, cells, specs, offload=offload))
    return programs


def host_copy(spec) -> tuple:
    """`(device sharding, host sharding)` of a saved value with spec `spec`."""
    return spec.sharding, spec.sharding.with_memory_kind(HOST)


def _unread_on_host(p: StageProgram, res_specs: list, reads: frozenset) -> tuple[list, tuple]:
    """The residual specs of a cell that reads the residuals at positions `reads`: an offloaded
    residual it does not read is passed as it lies, in host memory; and the offloaded residuals
    (indices among the forward's) it reads, which are copied back for it."""
    specs, reload, made = list(res_specs), [], -1
    for q, src in enumerate(p.cells.residual_sources):
        made += src is None
        if src is not None or made not in p.offload_res:
            continue
        if q in reads:
            reload.append(made)
        else:
            specs[q] = shape_spec(specs[q], host_copy(specs[q])[1])
    return specs, tuple(reload)


def forward_spec(layout: Layout, p: StageProgram, s: int, *, residuals: bool, donate: tuple = ()) -> CellSpec:
    """Stage `s`'s forward: edge outputs, results, and (with `residuals`) the saved residuals."""
    key = (residuals, donate)
    if key not in p.forwards:
        outs = [layout.output(v, s) for v in p.io.stage.edge_outputs]
        outs += [layout.named(s, None)] * len(p.io.stage.results)
        if residuals:
            outs += [layout.free(s)] * len(p.cells.produced_residual_avals)
        fn = p.cells.forward if residuals else p.cells.forward_only
        p.forwards[key] = CellSpec(fn, tuple(p.in_specs), tuple(outs), donate)
    return p.forwards[key]


def with_loss_spec(layout: Layout, p: StageProgram, s: int) -> StageProgram:
    """`p` with loss stage `s`'s fused value-and-grad cell."""
    return dataclasses.replace(p, specs={CellKind.LOSS: _loss_spec(layout, p, s)})


def _loss_spec(layout: Layout, p: StageProgram, s: int) -> CellSpec:
    io = p.io
    acc_sh = [layout.param(a, s) for a in io.params]
    acc_specs = [shape_spec(layout.accumulator_aval(a), sh) for a, sh in zip(io.params, acc_sh)]
    ct_in_sh = [layout.edge(io.stage.edge_inputs[k]) for k in io.diff_in]
    results_sh = [layout.named(s, None)] * (len(io.stage.results) - 1)
    loss = shape_spec(layout.accumulator_aval("loss"), layout.named(s, None))
    n_in = len(p.in_specs)
    return CellSpec(
        p.cells.loss_step,
        tuple(p.in_specs + acc_specs + [loss]),
        (*acc_sh, *ct_in_sh, layout.named(s, None), *results_sh),
        tuple(range(n_in, n_in + len(acc_specs))),  # not the loss: it starts from a constant
    )


def _made(compiler: Compiler, spec: CellSpec, skip: int, free, avals) -> list:
    """Specs of `spec`'s outputs from position `skip` on: on `free` when known before compiling,
    else as the compiled program makes them."""
    if free is not None:
        return [shape_spec(a, free) for a in avals]
    return [
        jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding)
        for o in compiler.compile_spec(spec).out_info[skip:]
    ]


def backward_specs(layout: Layout, p: StageProgram, s: int, compiler: Compiler, splits: bool) -> StageProgram:
    """`p` with stage `s`'s forward and backward specs (and I/W halves when the schedule splits)."""
    io, cells = p.io, p.cells
    acc_sh = [layout.param(a, s) for a in io.params]
    acc_specs = [shape_spec(layout.accumulator_aval(a), sh) for a, sh in zip(io.params, acc_sh)]
    ct_in_sh = [layout.edge(io.stage.edge_inputs[k]) for k in io.diff_in]
    forward = forward_spec(layout, p, s, residuals=not cells.remat)
    if cells.remat or not cells.produced_residual_avals:
        produced = []
    else:
        skip = len(io.stage.edge_outputs) + len(io.stage.results)
        produced = _made(compiler, forward, skip, layout.free(s), cells.produced_residual_avals)
    offload_res = offloaded([saved_bytes(a) for a in produced], p.offload.residuals)
    made = iter(produced)
    res_specs = [p.in_specs[src] if src is not None else next(made) for src in cells.residual_sources]
    ct_specs = [
        shape_spec(io.stage.edge_outputs[j].aval, layout.output(io.stage.edge_outputs[j], s))
        for j, consumers in zip(io.diff_out, io.ct_edges)
        for _ in consumers
    ]
    n_read = len(res_specs) + len(ct_specs)
    backward = CellSpec(
        cells.backward,
        tuple(res_specs + ct_specs + acc_specs),
        (*acc_sh, *ct_in_sh),
        tuple(range(n_read, n_read + len(acc_specs))),
    )
    p = dataclasses.replace(
        p,
        specs={CellKind.FORWARD: forward, CellKind.BACKWARD: backward},
        n_res=len(produced),
        res_specs=produced,
        offload_res=offload_res,
        reload={CellKind.BACKWARD: offload_res},
    )
    if not splits:
        return p
    i_fn, w_fn, n_stash, (i_reads, w_reads) = cells.split_backward()
    free = layout.free(s)
    i_res, i_reload = _unread_on_host(p, res_specs, i_reads)
    w_res, w_reload = _unread_on_host(p, res_specs, w_reads)
    input_grad = CellSpec(i_fn, tuple(i_res + ct_specs), (*ct_in_sh, *[free] * n_stash))
    stash = jax.eval_shape(i_fn, *res_specs, *ct_specs)[len(ct_in_sh) :] if free is not None else ()
    stash_specs = _made(compiler, input_grad, len(ct_in_sh), free, stash)
    n_w_in = n_read + n_stash
    weight_grad = CellSpec(
        w_fn,
        tuple(w_res + ct_specs + stash_specs + acc_specs),
        tuple(acc_sh),
        tuple(range(n_w_in, n_w_in + len(acc_specs))),
    )
    return dataclasses.replace(
        p,
        specs={**p.specs, CellKind.INPUT_GRAD: input_grad, CellKind.WEIGHT_GRAD: weight_grad},
        n_stash=n_stash,
        stash_specs=stash_specs,
        offload_stash=offloaded([saved_bytes(a) for a in stash_specs], p.offload.stash),
        reload={**p.reload, CellKind.INPUT_GRAD: i_reload, CellKind.WEIGHT_GRAD: w_reload},
    )
