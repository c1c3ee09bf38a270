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

from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..errors import StageSplitError
from .context import traced_mesh
from .graph import Edge, Stage, StageGraph
from .jax_private import ClosedJaxpr, JaxprEqn, Literal, Var
from .jaxpr import CALL_PRIMITIVES, contains_primitive, inline_calls, name_stack, resolve, sub_jaxprs
from .marker import sxstage_iter_p
from .region import DEFAULT_REGION, SCOPE_PREFIX, recording_regions, region_of

MARKER = sxstage_iter_p.name
_EXPENSIVE = frozenset(
    {"dot_general", "conv_general_dilated", "fft", "sort", "cumsum", "cumprod", "cumlogsumexp"}
)


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
    _check_markers_at_top(eqns)
    regions = [region_of(scope) for scope in scopes]
    outvars = tuple(resolve(v, mapping) for v in jaxpr.outvars)
    consts = dict(zip(jaxpr.constvars, closed.consts))
    consts.update(inner_consts)
    order, levels, read_levels = _stage_levels(eqns, regions, outvars, n_stages)
    placement = _placements(eqns, levels, read_levels, outvars, len(order) - 1)
    return _graph(jaxpr, eqns, placement, outvars, consts, order)


def _check_markers_at_top(eqns) -> None:
    for eqn in eqns:
        if _has_marker(eqn):
            raise StageSplitError(
                f"sxstage_iter found inside a `{eqn.primitive.name}` body: stage markers may appear "
                "at the top level of the function or inside jax.jit / jax.checkpoint helpers, not "
                "inside scan / cond / while_loop bodies. Move the marker out of the loop or branch."
            )


def _stage_levels(eqns, regions, outvars, n_stages: int):
    """`(order, levels, read_levels)`: the stages' `(region, local stage)` in order, and per
    equation the stage its markers put it in and the stage it reads at (None: free)."""
    named = any(r != DEFAULT_REGION for r in regions)
    n_markers = sum(eqn.primitive.name == MARKER for eqn in eqns)
    if not named and n_markers != n_stages - 1:
        raise StageSplitError(
            f"found {n_markers} stage marker(s) (sxstage_iter), which cut the function into "
            f"{n_markers + 1} stage(s); the mesh and schedule need {n_stages} stages "
            f"(pipeline ranks x virtual stages), i.e. {n_stages - 1} markers. Add or remove "
            "sxstage_iter calls, or change the mesh's pipeline axis / the schedule."
        )
    keys, read_keys = _forward_levels(eqns, regions, lexical=named)
    if named:
        producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}
        loss = producer.get(outvars[0]) if outvars and isinstance(outvars[0], Var) else None
        order = _stage_order(eqns, regions, keys, read_keys, keys[loss] if loss is not None else None)
    else:
        order = tuple((DEFAULT_REGION, s) for s in range(n_markers + 1))
    number = {key: s for s, key in enumerate(order)}
    levels = [number[k] if k is not None else None for k in keys]
    read_levels = [number[k] if k is not None else None for k in read_keys]
    return order, levels, read_levels


def _graph(jaxpr, eqns, placement, outvars, consts, order) -> StageGraph:
    """The stage graph of equations placed on stages: each stage's equations, the argument
    leaves and constants it reads, and an edge for each value it reads from another stage."""
    n_stages, last = len(order), len(order) - 1
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
    out_stages = [
        Stage(
            index=s,
            eqns=tuple(stage_eqns[s]),
            arg_inputs=tuple(sorted(args)),
            edge_inputs=tuple(e for e in edge_list if e.dst == s),
            edge_outputs=tuple(dict.fromkeys(e.var for e in edge_list if e.src == s)),
            results=tuple(j for j in range(len(outvars)) if result_stage[j] == s),
            consts=stage_consts,
            outvars=outvars,
            invars=tuple(jaxpr.invars),
        )
        for s, args, stage_consts in stages
    ]
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

    with recording_regions() as regions, traced_mesh():
        closed = jax.make_jaxpr(flat_fn)(*on_context_mesh(flat))
    return closed, in_tree, box[0], regions


def on_context_mesh(leaves: Sequence) -> list:
    """`leaves` as abstract values on JAX's context mesh (the ranks' abstract submesh while a plan
    is built, see `context.building_for`), replicated, so that values the function makes and the
    arguments it reads share one mesh; unchanged without a context mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return list(leaves)
    placed = NamedSharding(mesh, PartitionSpec())
    avals = [x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) for x in leaves]
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=placed) for a in avals]
