"""Emit the steps of each issued action: its cell, then the sends of what it made.

A move to a receiver that reads the value with the sharding it already has is
no step at all: the receiver's slot is an alias of the sender's.
"""

from __future__ import annotations

import numpy as np

from .._comm import transfer
from .._runtime.slots import (
    Activation,
    CellKind,
    Cotangent,
    GradAccumulator,
    Input,
    InputCotangent,
    InputKind,
    LossAccumulator,
    MicrobatchIndex,
    Offloaded,
    Residual,
    Result,
    StageOutput,
    Stash,
)
from .draft import Draft
from .layout import Layout
from .programs import StageProgram, host_copy


def move(draft: Draft, pairs: list[tuple]) -> None:
    """Move `(src slot, dst key, dst sharding, src sharding)` values in one transfer step; a move
    to the same sharding becomes an alias of the source slot."""
    moves = []
    for src, dst_key, sharding, src_sharding in pairs:
        if sharding == src_sharding:
            draft.alias(dst_key, src)
        else:
            moves.append((src, draft.slot(dst_key), sharding, src_sharding))
    if moves:
        fn = transfer([m[3] for m in moves], [m[2] for m in moves])
        draft.add(fn, [m[0] for m in moves], [m[1] for m in moves])


def cell_inputs(draft: Draft, layout: Layout, p: StageProgram, s: int, i: int) -> list[int]:
    """Slots of stage `s`'s inputs for microbatch `i`, in the cells' argument order."""
    io, r = p.io, layout.ranks[s]
    slots = [draft.slot(Input(InputKind.PARAM, a, r)) for a in io.params]
    slots += [draft.slot(Input(InputKind.FIXED, a, r)) for a in io.fixed]
    slots += [draft.slot(Input(InputKind.BATCH, layout.batch_leaf(a, i), r)) for a in io.batch]
    index = MicrobatchIndex(r, i)
    if index not in draft.named:
        draft.constants[draft.slot(index)] = (np.int32(i), layout.named(s, None))
    slots.append(draft.slot(index))
    return slots + [draft.slot(Activation(layout.edge_index[e], i)) for e in io.stage.edge_inputs]


def emit_forward(
    draft: Draft, layout: Layout, p: StageProgram, cell, s: int, i: int, n_res: int
) -> list[int]:
    """A forward step of stage `s` on microbatch `i`, then the sends of its outputs; returns the
    slots of the function outputs it computes."""
    io, graph = p.io, layout.graph
    outs = [draft.slot(StageOutput(s, j, i)) for j in range(len(io.stage.edge_outputs))]
    results = [draft.new() for _ in io.stage.results]
    res = [draft.slot(Residual(s, i, k)) for k in range(n_res)]
    draft.add(cell, cell_inputs(draft, layout, p, s, i), outs + results + res)
    edge_index = layout.edge_index
    move(
        draft,
        [
            (outs[j], Activation(edge_index[e], i), layout.edge(e), layout.output(v, s))
            for j, v in enumerate(io.stage.edge_outputs)
            for e in graph.consumers(s)[v]
        ],
    )
    return gather_results(draft, layout, s, i, io.stage.results, results)


def gather_results(draft: Draft, layout: Layout, s: int, i: int, outputs, made: list[int]) -> list[int]:
    """The function outputs `outputs` stage `s` made for microbatch `i` (in slots `made`), as
    `Result` slots on the rank of each output's `result_stage` (moved there from a stage copy
    on another rank)."""
    home = layout.graph.result_stage
    move(
        draft,
        [
            (slot, Result(j, i), layout.named(home[j], None), layout.named(s, None))
            for j, slot in zip(outputs, made)
        ],
    )
    return [draft.slot(Result(j, i)) for j in outputs]


def send_cotangents(draft: Draft, layout: Layout, p: StageProgram, i: int) -> None:
    """Send stage's input cotangents for microbatch `i` back to the stages that made the inputs."""
    edge_index = layout.edge_index
    pairs = []
    for k in p.io.diff_in:
        e = p.io.stage.edge_inputs[k]
        ek = edge_index[e]
        pairs.append(
            (draft.slot(InputCotangent(ek, i)), Cotangent(ek, i), layout.output(e.var, e.src), layout.edge(e))
        )
    move(draft, pairs)


def _input_cotangents(draft: Draft, layout: Layout, p: StageProgram, i: int) -> list[int]:
    edge_index = layout.edge_index
    return [draft.slot(InputCotangent(edge_index[p.io.stage.edge_inputs[k]], i)) for k in p.io.diff_in]


def residual_slots(draft: Draft, layout: Layout, p: StageProgram, s: int, i: int, kind: str) -> list[int]:
    """The slots of stage `s`'s residuals for microbatch `i` as its `kind` cell reads them, in the
    backward's order: inputs the backward reads as they are, then what the forward computed (an
    offloaded one the cell reads moved back to the device first, see `reload`; one it does not
    read passed as it lies, in host memory)."""
    ins, made = cell_inputs(draft, layout, p, s, i), iter(range(p.n_res))
    computed = reload(draft, "residuals", s, i, p.n_res, p.reload[kind], p.res_specs)
    computed = [
        draft.slot(Offloaded("residuals", s, i, k))
        if k in p.offload_res and k not in p.reload[kind]
        else slot
        for k, slot in enumerate(computed)
    ]
    return [ins[src] if src is not None else computed[next(made)] for src in p.cells.residual_sources]


def offload(draft: Draft, kind: str, s: int, i: int, made: list[int], chosen: tuple, specs: list) -> None:
    """Move the values at positions `chosen` of `made` (stage `s`'s residuals or stash for
    microbatch `i`) to host memory, as `Offloaded` slots; the device buffers are freed."""
    if chosen:
        pairs = [(made[k], Offloaded(kind, s, i, k), *reversed(host_copy(specs[k]))) for k in chosen]
        move(draft, pairs)


def reload(draft: Draft, kind: str, s: int, i: int, count: int, chosen: tuple, specs: list) -> list[int]:
    """The slots of stage `s`'s `count` saved values of `kind` for microbatch `i`, those at
    positions `chosen` copied back from host memory by one transfer issued just before the
    cell that reads them (a fresh device copy per reading cell, freed after it)."""
    key = Residual if kind == "residuals" else Stash
    slots = [draft.slot(key(s, i, k)) for k in range(count)]
    if chosen:
        fresh = {k: draft.new() for k in chosen}
        device, host = zip(*(host_copy(specs[k]) for k in chosen))
        fn = transfer(list(host), list(device))
        draft.add(fn, [draft.slot(Offloaded(kind, s, i, k)) for k in chosen], list(fresh.values()))
        slots = [fresh.get(k, slot) for k, slot in enumerate(slots)]
    return slots


def emit_loss_step(draft: Draft, layout: Layout, p: StageProgram, s: int, i: int) -> None:
    """Loss stage `s`'s fused forward and backward on microbatch `i`, then its cotangent sends."""
    ins = cell_inputs(draft, layout, p, s, i)
    acc = [draft.slot(GradAccumulator(s, a)) for a in p.io.params]
    ct_out = _input_cotangents(draft, layout, p, i)
    outputs = [j for j in p.io.stage.results if j != 0]
    results = [draft.new() for _ in outputs]
    loss = draft.slot(LossAccumulator(s))
    draft.add(p.specs[CellKind.LOSS], ins + acc + [loss], acc + ct_out + [loss] + results)
    send_cotangents(draft, layout, p, i)
    gather_results(draft, layout, s, i, outputs, results)


def emit_part(draft: Draft, layout: Layout, programs: list[StageProgram], a) -> str:
    """Emit one action part (`F`, `B`, `I` or `W` of one stage and microbatch); returns the
    label of the cell it ran (`-` for none: the last stage's backward ran fused with its F)."""
    s, i, kind = a.stage, a.microbatch, a.kind
    p = programs[s]
    if layout.is_loss(s):
        if kind == CellKind.FORWARD:
            emit_loss_step(draft, layout, p, s, i)
            return CellKind.LOSS
        return "-"
    if kind == CellKind.FORWARD:
        emit_forward(draft, layout, p, p.specs[CellKind.FORWARD], s, i, p.n_res)
        made = [draft.slot(Residual(s, i, k)) for k in range(p.n_res)]
        offload(draft, "residuals", s, i, made, p.offload_res, p.res_specs)
        return CellKind.FORWARD
    cts = [draft.slot(Cotangent(k, i)) for group in p.io.ct_edges for k in group]
    acc = [draft.slot(GradAccumulator(s, leaf)) for leaf in p.io.params]
    ct_out = _input_cotangents(draft, layout, p, i)
    if kind == CellKind.BACKWARD:
        draft.add(
            p.specs[CellKind.BACKWARD],
            residual_slots(draft, layout, p, s, i, CellKind.BACKWARD) + cts + acc,
            acc + ct_out,
        )
        send_cotangents(draft, layout, p, i)
        return kind
    if kind == CellKind.INPUT_GRAD:
        stash = [draft.slot(Stash(s, i, k)) for k in range(p.n_stash)]
        if ct_out or stash:  # an I cell with nothing to return (first stage, no stash) is skipped
            draft.add(
                p.specs[CellKind.INPUT_GRAD],
                residual_slots(draft, layout, p, s, i, CellKind.INPUT_GRAD) + cts,
                ct_out + stash,
            )
        send_cotangents(draft, layout, p, i)
        offload(draft, "stash", s, i, stash, p.offload_stash, p.stash_specs)
    else:
        res = residual_slots(draft, layout, p, s, i, CellKind.WEIGHT_GRAD)
        stash = reload(draft, "stash", s, i, p.n_stash, p.offload_stash, p.stash_specs)
        draft.add(p.specs[CellKind.WEIGHT_GRAD], res + cts + stash + acc, acc)
    return kind


def emit_action(
    draft: Draft, layout: Layout, programs: list[StageProgram], rank: int, action, pick=None
) -> None:
    """Emit an issued action (its parts fused into one cell when it has several); `pick(part)`
    gives the `(layout, programs)` a part runs with where they differ per microbatch."""
    start = len(draft.steps)
    pick = pick or (lambda part: (layout, programs))
    labels = [emit_part(draft, *pick(p), p) for p in action.parts]
    if len(action.parts) > 1:
        draft.fuse_since(start)
    forwards = [(p.stage, p.microbatch) for p in action.parts if p.kind == CellKind.FORWARD]
    if forwards:
        draft.forward_steps[start] = forwards
    draft.record(rank, action, start, "&".join(label for label in labels if label != "-") or "-")
