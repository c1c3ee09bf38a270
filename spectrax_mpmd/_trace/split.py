"""Trace a function once and cut its jaxpr at `sxstage_iter` markers into stage clusters.

Pass 1 (forward) gives every value a stage: the latest stage among its inputs,
with marker `k`'s outputs starting stage `k + 1`. Values that depend on the
function's arguments only ("free" values: a weight transpose, a one-hot of
labels, the embedding lookup of stage 0) get no stage in pass 1; pass 2
(backward) places each free equation where it is read: cheap ones are
recomputed in every stage that reads them, expensive ones (matmuls, loops,
calls) run once, in the earliest such stage, and travel. A marker reads its
inputs in the stage it ends, so a free value feeding marker `k` is computed
in stage `k`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
from jax.sharding import PartitionSpec

from spectrax_core.schedules import Flow

from ..errors import StageSplitError
from .jax_private import ClosedJaxpr, JaxprEqn, Literal, Var
from .jaxpr import (
    CALL_PRIMITIVES,
    contains_primitive,
    eval_eqns,
    inline_calls,
    name_stack,
    read,
    resolve,
    sub_jaxprs,
)
from .marker import sxstage_iter_p
from .region import DEFAULT_REGION, SCOPE_PREFIX, recording_regions, region_of

MARKER = sxstage_iter_p.name
_EXPENSIVE = frozenset(
    {"dot_general", "conv_general_dilated", "fft", "sort", "cumsum", "cumprod", "cumlogsumexp"}
)


@dataclass(frozen=True)
class Edge:
    """Value `var`, computed in stage `src`, read by stage `dst` with `spec` on the receiver."""

    var: Var
    src: int
    dst: int
    spec: PartitionSpec | None = None

    @property
    def aval(self):
        return self.var.aval

    @property
    def differentiable(self) -> bool:
        return jax.dtypes.issubdtype(self.var.aval.dtype, jax.numpy.inexact)

    def __repr__(self) -> str:
        return f"{self.src}->{self.dst} {self.var.aval.str_short()}"


@dataclass
class Stage:
    """One stage cluster: its equations, what it reads and what it produces."""

    index: int
    eqns: tuple[JaxprEqn, ...]
    arg_inputs: tuple[int, ...]
    edge_inputs: tuple[Edge, ...]
    edge_outputs: tuple[Var, ...]
    results: tuple[int, ...]
    consts: dict = field(repr=False)
    outvars: tuple = field(repr=False)
    invars: tuple = field(repr=False)

    def run(self, args: Sequence[Any], edges: Sequence[Any]) -> tuple[list, list]:
        """Evaluate the stage: `args` aligned with `arg_inputs`, `edges` with `edge_inputs`.

        Returns `(edge_output_values, result_values)`.
        """
        env = dict(self.consts)
        env.update(zip((self.invars[i] for i in self.arg_inputs), args))
        env.update(zip((e.var for e in self.edge_inputs), edges))
        eval_eqns(self.eqns, env)
        return [env[v] for v in self.edge_outputs], [read(env, self.outvars[j]) for j in self.results]

    def __repr__(self) -> str:
        return (
            f"Stage({self.index}: {len(self.eqns)} eqns, args={list(self.arg_inputs)}, "
            f"in={list(self.edge_inputs)}, out={[v.aval.str_short() for v in self.edge_outputs]}, "
            f"results={list(self.results)})"
        )


@dataclass
class StageGraph:
    """The stage clusters of one traced function, and the edges between them."""

    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    in_avals: tuple
    out_avals: tuple
    result_stage: tuple[int, ...]
    stage_regions: tuple[tuple[str, int], ...] = ()  # per stage: (region, its index in the region)

    @property
    def has_regions(self) -> bool:
        return any(region != DEFAULT_REGION for region, _ in self.stage_regions)

    def flow(self) -> Flow:
        """What each cell waits for: every edge feeds its destination's forward; the
        differentiable ones carry a gradient back to their source's backward."""
        return Flow.from_edges(
            len(self.stages),
            [(e.src, e.dst) for e in self.edges],
            [(e.src, e.dst) for e in self.edges if e.differentiable],
        )

    def consumers(self, stage: int) -> dict[Var, list[Edge]]:
        """Edges leaving `stage`, grouped by the value they carry."""
        out: dict[Var, list[Edge]] = {}
        for e in self.edges:
            if e.src == stage:
                out.setdefault(e.var, []).append(e)
        return out

    def __repr__(self) -> str:
        return "StageGraph(\n" + "\n".join(f"  {s!r}" for s in self.stages) + "\n)"


def _has_marker(eqn: JaxprEqn) -> bool:
    return any(contains_primitive(j, MARKER) for j in sub_jaxprs(eqn))


def _opens_region(jaxpr) -> bool:
    return any(
        SCOPE_PREFIX in name_stack(eqn) or any(_opens_region(j) for j in sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def _inline(eqn: JaxprEqn) -> bool:
    """Calls whose bodies hold a marker or open a region are flattened into the stage split."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return False
    return _has_marker(eqn) or any(_opens_region(j) for j in sub_jaxprs(eqn))


def _is_cheap(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name not in _EXPENSIVE and not any(True for _ in sub_jaxprs(eqn))


def _forward_levels(eqns: Sequence[JaxprEqn], regions: Sequence[str], lexical: bool) -> tuple[list, list]:
    """Pass 1: the stage `(region, local index)` of every equation whose inputs are staged, and
    the stage each marker ends (where it reads its inputs).

    An equation belongs to the region it is traced in, at the latest stage of its inputs
    from that region — or, reading only other regions' values, at the stage its region has
    reached. With `lexical` (named regions present) an equation of a named region that reads
    no staged value is placed there too; otherwise it is free and goes where it is read.
    """
    reached: dict[str, int] = {}
    level: dict = {}
    levels: list = []
    reads: list = []
    for eqn, region in zip(eqns, regions):
        k = reached.setdefault(region, 0)
        ins = [level[v] for v in eqn.invars if not isinstance(v, Literal) and level.get(v) is not None]
        own = [j for r, j in ins if r == region]
        where = "" if region == DEFAULT_REGION else f" of region {region!r}"
        if eqn.primitive.name == MARKER:
            declared = eqn.params["stage"]
            if declared is not None and declared != k:
                raise StageSplitError(
                    f"sxstage_iter(stage={declared}) is the marker that ends stage {k}{where} "
                    f"(markers are numbered in program order from 0); pass stage={k} or omit it."
                )
            if own and max(own) > k:
                raise StageSplitError(
                    f"sxstage_iter: the marker ending stage {k}{where} receives a value computed in "
                    f"stage {max(own)}; markers must follow the order of the data flow."
                )
            lvl, read = (region, k + 1), (region, k)
            reached[region] = k + 1
        elif own:
            lvl = read = (region, max(own))
        elif ins or (lexical and region != DEFAULT_REGION):
            lvl = read = (region, k)
        else:
            lvl = read = None
        levels.append(lvl)
        reads.append(read)
        for v in eqn.outvars:
            level[v] = lvl
    return levels, reads


def _stage_order(eqns, regions, levels, reads, loss_stage) -> tuple[tuple[str, int], ...]:
    """Number the stages of every region in one topological order of their data flow, ties in
    trace order, the stage computing the loss last. Raises on a cycle between regions."""
    first: dict = {}
    feeds: dict = {}
    level = {}
    for i, (eqn, lvl, at) in enumerate(zip(eqns, levels, reads)):
        if lvl is None:
            continue
        for key in (at, lvl):
            first.setdefault(key, i)
            feeds.setdefault(key, set())
        if at != lvl:
            feeds[at].add(lvl)
        for v in eqn.invars:
            src = level.get(v) if not isinstance(v, Literal) else None
            if src is not None and src != at:
                feeds.setdefault(src, set()).add(at)
        for v in eqn.outvars:
            level[v] = lvl
    for region in dict.fromkeys(regions):  # a region's stages follow one another
        local = sorted(j for r, j in first if r == region)
        for j in range(1, len(local)):
            feeds[(region, local[j - 1])].add((region, local[j]))
    indegree = {key: 0 for key in feeds}
    for dsts in feeds.values():
        for d in dsts:
            indegree[d] += 1
    ready = [(key == loss_stage, first[key], key) for key, k in indegree.items() if k == 0]
    order = []
    while ready:
        ready.sort()
        _, _, key = ready.pop(0)
        order.append(key)
        for d in feeds[key]:
            indegree[d] -= 1
            if indegree[d] == 0:
                ready.append((d == loss_stage, first[d], d))
    if len(order) < len(feeds):
        stuck = sorted({r for (r, _), k in indegree.items() if k > 0})
        raise StageSplitError(
            f"the regions {stuck} read each other's values in a cycle; data must flow one way between "
            "regions (a region may read another's output only if that one reads nothing of it)."
        )
    return tuple(order)


def _placements(eqns, levels, reads, outvars, last: int) -> list[set[int]]:
    demand: dict = {}
    for v in outvars:
        if isinstance(v, Var):
            demand.setdefault(v, set()).add(last)
    placement: list[set[int]] = [set() for _ in eqns]
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if levels[i] is not None:
            place, reads_at = {levels[i]}, {reads[i]}
        else:
            want = set().union(*(demand.get(v, set()) for v in eqn.outvars))
            place = want if (not want or _is_cheap(eqn)) else {min(want)}
            reads_at = place
        placement[i] = place
        for v in eqn.invars:
            if isinstance(v, Var):
                demand.setdefault(v, set()).update(reads_at)
    return placement


def split(closed: ClosedJaxpr, n_stages: int) -> StageGraph:
    """Cut `closed` into stage clusters at its `sxstage_iter` markers.

    Without regions: `n_stages` clusters in a chain (a marker count that does not
    give `n_stages` is an error). With `sxstage_region`s: each region's markers cut
    its own stages; `StageGraph.stage_regions` says which region and local stage
    each cluster is (the regions' schedules check the counts).
    """
    jaxpr = closed.jaxpr
    eqns, mapping, inner_consts, scopes = inline_calls(jaxpr, _inline)
    for eqn in eqns:
        if _has_marker(eqn):
            raise StageSplitError(
                f"sxstage_iter found inside a `{eqn.primitive.name}` body: stage markers may appear "
                "at the top level of the function or inside jax.jit / jax.checkpoint helpers, not "
                "inside scan / cond / while_loop bodies. Move the marker out of the loop or branch."
            )
    regions = [region_of(scope) for scope in scopes]
    named = any(r != DEFAULT_REGION for r in regions)
    n_markers = sum(eqn.primitive.name == MARKER for eqn in eqns)
    if not named and n_markers != n_stages - 1:
        raise StageSplitError(
            f"found {n_markers} stage marker(s) (sxstage_iter), which cut the function into "
            f"{n_markers + 1} stage(s); the mesh and schedule need {n_stages} stages "
            f"(pipeline ranks x virtual stages), i.e. {n_stages - 1} markers. Add or remove "
            "sxstage_iter calls, or change the mesh's pipeline axis / the schedule."
        )
    outvars = tuple(resolve(v, mapping) for v in jaxpr.outvars)
    consts = dict(zip(jaxpr.constvars, closed.consts))
    consts.update(inner_consts)
    keys, read_keys = _forward_levels(eqns, regions, lexical=named)
    if named:
        producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
        loss = producer.get(outvars[0]) if outvars and isinstance(outvars[0], Var) else None
        order = _stage_order(eqns, regions, keys, read_keys, keys[loss] if loss is not None else None)
    else:
        order = tuple((DEFAULT_REGION, s) for s in range(n_markers + 1))
    number = {key: s for s, key in enumerate(order)}
    n_stages = len(order)
    levels = [number[k] if k is not None else None for k in keys]
    read_levels = [number[k] if k is not None else None for k in read_keys]
    last = n_stages - 1
    placement = _placements(eqns, levels, read_levels, outvars, last)

    arg_index = {v: i for i, v in enumerate(jaxpr.invars)}
    placed_at: dict = {}
    for i, eqn in enumerate(eqns):
        placed_at.update((v, sorted(placement[i])) for v in eqn.outvars if isinstance(v, Var))

    def source(v, dst: int) -> int:
        below = [s for s in placed_at[v] if s <= dst]
        return below[-1] if below else placed_at[v][0]

    stage_eqns = [[eqns[i] for i in range(len(eqns)) if s in placement[i]] for s in range(n_stages)]
    result_stage = tuple(source(v, last) if isinstance(v, Var) and v in placed_at else last for v in outvars)
    edges: dict[tuple, Edge] = {}
    stages = []
    for s in range(n_stages):
        defined = {v for eqn in stage_eqns[s] for v in eqn.outvars}
        args: dict[int, None] = {}
        stage_consts: dict = {}
        reads = [(v, eqn) for eqn in stage_eqns[s] for v in eqn.invars]
        reads += [(outvars[j], None) for j in range(len(outvars)) if result_stage[j] == s]
        for v, eqn in reads:
            if isinstance(v, Literal) or v in defined:
                continue
            if v in consts:
                stage_consts[v] = consts[v]
            elif v in arg_index:
                args[arg_index[v]] = None
            else:
                spec = None
                if eqn is not None and eqn.primitive.name == MARKER:
                    spec = eqn.params["sharding"][list(eqn.invars).index(v)]
                key = (v, s)
                if key not in edges or (spec is not None and edges[key].spec is None):
                    edges[key] = Edge(v, source(v, s), s, spec)
        stages.append((s, args, stage_consts))
    edge_list = tuple(edges.values())
    out_stages = []
    for s, args, stage_consts in stages:
        sent = tuple(dict.fromkeys(e.var for e in edge_list if e.src == s))
        out_stages.append(
            Stage(
                index=s,
                eqns=tuple(stage_eqns[s]),
                arg_inputs=tuple(sorted(args)),
                edge_inputs=tuple(e for e in edge_list if e.dst == s),
                edge_outputs=sent,
                results=tuple(j for j in range(len(outvars)) if result_stage[j] == s),
                consts=stage_consts,
                outvars=outvars,
                invars=tuple(jaxpr.invars),
            )
        )
    return StageGraph(
        stages=tuple(out_stages),
        edges=edge_list,
        in_avals=tuple(v.aval for v in jaxpr.invars),
        out_avals=tuple(v.aval for v in outvars),
        result_stage=result_stage,
        stage_regions=order,
    )


def trace(fn: Callable, args: Sequence[Any]) -> tuple[ClosedJaxpr, Any, Any, dict]:
    """Trace `fn(*args)` to a closed jaxpr over flat leaves; returns `(jaxpr, in_tree, out_tree,
    regions)`, the last `{name: schedule}` of the `sxstage_region`s entered."""
    flat, in_tree = jax.tree.flatten(tuple(args))
    box: list = []

    def flat_fn(*leaves):
        out = fn(*jax.tree.unflatten(in_tree, leaves))
        out_leaves, out_tree = jax.tree.flatten(out)
        box.append(out_tree)
        return out_leaves

    with recording_regions() as regions:
        closed = jax.make_jaxpr(flat_fn)(*flat)
    return closed, in_tree, box[0], regions
