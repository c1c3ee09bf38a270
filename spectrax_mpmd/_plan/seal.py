"""Seal a draft into a runnable plan: compile every cell, place the constants, name the inputs
and their shardings, and free each buffer after its last use."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from .._compile.compiler import CellSpec, Compiler
from .._env import configured_fuse_cells
from .._runtime.plan import Plan, Step
from .._runtime.slots import Activation, CellKind, Input, InputKind, Offloaded, Residual, Stash
from .draft import Draft
from .fusion import Deferred, fuse
from .layout import REPLICATED, Layout
from .localize import localize
from .moves import batched_moves
from .programs import StageProgram


def _free_after_last_use(steps: list, keep: set[int]) -> list:
    last: dict[int, int] = {}
    for k, (_, ins, outs, _) in enumerate(steps):
        for i in (*ins, *outs):
            last[i] = k
    frees: dict[int, list[int]] = {}
    for slot, k in last.items():
        if slot not in keep:
            frees.setdefault(k, []).append(slot)
    return [Step(fn, ins, outs, tuple(frees.get(k, ()))) for k, (fn, ins, outs, _) in enumerate(steps)]


def seal(
    draft: Draft,
    layout: Layout,
    compiler: Compiler,
    schedule,
    function_leaves: tuple | None = None,
    **metadata,
) -> Plan:
    """The runnable plan of `draft` for this process (`localize` first, in a multi-process job).

    `draft.outputs` are kept alive to the end; `metadata` fills the plan's descriptive
    fields (see `describe_training`). With `function_leaves` (a whole function's plan: the
    function's leaf each pipeline leaf reads), the plan's input keys number the leaves as the
    function does (an epilogue's own inputs already do)."""
    keep = {slot for value in draft.outputs.values() for slot in _slots(value)}
    keep = localize(draft, layout, compiler, keep)
    local = draft.local_ranks
    placed = [
        (slot, key)
        for key, slot in draft.named.items()
        if isinstance(key, Input) and (local is None or key.rank in local) and key not in draft.received
    ]
    input_shardings = [
        NamedSharding(layout.mesh.submesh(key.rank), _input_spec(draft, layout, key) or REPLICATED)
        for _, key in placed
    ]
    input_keys = [(slot, _numbered(key, function_leaves)) for slot, key in placed]
    issued, issued_of, only_fused = fuse(draft.steps, keep, configured_fuse_cells())
    issued, issued_of = batched_moves(issued, issued_of, within=len(set(layout.ranks)))
    const_slots = {}
    if draft.constants:
        values, shardings = zip(*draft.constants.values())
        const_slots = dict(zip(draft.constants, jax.device_put(list(values), list(shardings))))
    fused = len(issued) < len(draft.steps)
    fields = dict(
        issued_of=issued_of if fused else (),
        log=draft.log,
        n_slots=draft.count,
        const_slots=const_slots,
        input_keys=input_keys,
        input_shardings=input_shardings,
        output_slots=draft.outputs,
        stage_ranks=layout.ranks,
        action_steps=draft.action_steps,
        device_rank=layout.mesh.device_rank,
        graph=layout.graph,
        schedule=schedule,
        transport=draft.transport,
        local_ranks=draft.local_ranks,
        remote_outputs=draft.remote_outputs,
        **metadata,
    )
    compiler.prefetch(  # with the companions' programs, all started by one scheduler
        [
            *_companions(compiler, draft.steps, issued if fused else [], fields),
            *(st.fn for st in issued if isinstance(st.fn, CellSpec)),
        ]
    )

    deferred = {fn: Deferred(compiler.compile_spec, fn) for fn in only_fused}

    def compiled(fn):
        if fn in deferred:
            return deferred[fn]
        return compiler.compile_spec(fn) if isinstance(fn, CellSpec) else fn

    hot = issued if fused else draft.steps
    issued_specs = tuple(fn if isinstance(fn, CellSpec) else None for fn, *_ in hot)
    steps = [Step(compiled(fn), ins, outs) for fn, ins, outs, _ in draft.steps]
    issued = [Step(compiled(fn), ins, outs) for fn, ins, outs, _ in issued] if fused else []
    return Plan(
        steps=_free_after_last_use(steps, keep),
        issued=_free_after_last_use(issued, keep),
        issued_specs=issued_specs,
        **fields,
    )


def _companions(compiler: Compiler, steps: list, issued: list, fields: dict) -> list[CellSpec]:
    """The specs `compiler.companions` ask to compile with the plan's programs, each given the plan
    with its cells not compiled yet (its shardings are those the sealed plan will have)."""
    if not compiler.companions:
        return []
    blueprint = Plan(
        steps=[Step(fn, ins, outs) for fn, ins, outs, _ in steps],
        issued=[Step(fn, ins, outs) for fn, ins, outs, _ in issued],
        **fields,
    )
    return [spec for companion in compiler.companions for spec in companion(blueprint)]


def _numbered(key: Input, function_leaves: tuple | None) -> Input:
    if function_leaves is None or key.kind == InputKind.AFTER:
        return key
    return key._replace(leaf=function_leaves[key.leaf])


def _input_spec(draft: Draft, layout: Layout, key: Input):
    if key.kind == InputKind.PARAM:
        return layout.param_spec(key.leaf, key.rank)
    return draft.input_specs.get(key)


def _slots(value) -> list[int]:
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, list):
        return value
    return [value]


def describe_training(draft: Draft, layout: Layout, programs: list[StageProgram]) -> dict:
    """What measurements need to know of a training plan's slots and cells, from the full
    (not yet localized) draft: which buffers hold a `(stage, microbatch)` activation, each
    slot's key, the cell specs by `(stage, kind)`, which of them run, and how many outputs
    each forward and I cell keeps per microbatch."""
    activation_slots: dict = {}
    for key, slot in draft.named.items():
        if isinstance(key, (Residual, Stash, Offloaded)):
            activation_slots[slot] = (layout.ranks[key.stage], key.stage, key.microbatch)
        elif isinstance(key, Activation) and _kept_for_backward(
            layout, programs, layout.graph.edges[key.edge]
        ):
            e = layout.graph.edges[key.edge]
            activation_slots.setdefault(slot, (layout.ranks[e.dst], e.dst, key.microbatch))
    cells = {(s, kind): spec for s, p in enumerate(programs) for kind, spec in p.specs.items()}
    emitted = {st.fn for st in draft.steps if isinstance(st.fn, CellSpec)}
    emitted.update(part for parts in draft.fused for part in parts)
    saved = {}
    for s, p in enumerate(programs):
        if CellKind.FORWARD in p.specs:
            saved[(s, CellKind.FORWARD)] = p.n_res
        if CellKind.INPUT_GRAD in p.specs:
            saved[(s, CellKind.INPUT_GRAD)] = p.n_stash
    return {
        "activation_slots": activation_slots,
        "slot_names": {slot: key for key, slot in draft.named.items()},
        "forward_steps": draft.forward_steps,
        "cells": cells,
        "ran": frozenset(key for key, spec in cells.items() if spec in emitted),
        "saved": saved,
    }


def _kept_for_backward(layout: Layout, programs: list[StageProgram], e) -> bool:
    """Whether the activation `e` brings to its stage is kept for that stage's backward."""
    if layout.is_loss(e.dst):
        return False
    io = programs[e.dst].io
    position = io.n_in - len(io.stage.edge_inputs) + io.stage.edge_inputs.index(e)
    return position in programs[e.dst].cells.residual_sources
