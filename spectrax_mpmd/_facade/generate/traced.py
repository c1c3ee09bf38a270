"""A user's decode step cut at its `sxstage_iter` markers, and the cache part each stage owns.

The step is `step(params, cache, tokens, positions) -> (logits, cache)`:
`tokens` and `positions` are `(batch, length)` (one token per sequence while
decoding, a prompt chunk while prefilling), `logits` `(batch, length, vocab)`.
It is traced once per chunk length, as one `sxstage_region`, and split at its
markers (`_trace.split`): inside a region every equation belongs to the stage
its place in the program gives it (after the markers before it), also one
that reads only arguments, such as the first layer's cache write, which would
otherwise float to where its value is used. Each cache leaf the step changes must be read and
written by one stage only, the stage that owns it; a leaf crossing stages is an
error naming it, raised before anything runs, so a stage's cache can stay on its
rank. A leaf the step returns unchanged (read only: an encoder's output, offsets
per sequence) is no stage's result: every stage that reads it owns a copy of it,
made on its rank, which no cell changes.

Between consecutive stages travels one bundle: every value a later stage reads
from an earlier one (the split's edges), and the tokens when a stage after the
first reads them. The positions are not carried: each stage holds its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from ..._trace.region import sxstage_region
from ..._trace.split import split, trace
from ...errors import MpmdError, StageSplitError

REGION = "decode_step"  # the region the step is traced in
TOKENS = "tokens"  # the bundle key of the tokens, when a stage after the first reads them


@dataclass(frozen=True)
class Slots:
    """Where the step's flat argument leaves sit: params `[0, n_params)`, cache leaves next, then
    the tokens and the positions; `names` are the cache leaves' paths (for errors)."""

    n_params: int
    names: tuple[str, ...]

    @property
    def tokens(self) -> int:
        return self.n_params + len(self.names)

    def kind(self, i: int) -> str:
        if i < self.n_params:
            return "param"
        return "cache" if i < self.tokens else "tokens" if i == self.tokens else "positions"


@dataclass(frozen=True)
class StepSplit:
    """The step for one chunk length, cut into stages: per stage the params it reads, the cache
    leaves it owns, and the bundle keys it receives and passes on."""

    graph: object  # _trace.graph.StageGraph
    slots: Slots
    params: tuple[tuple[int, ...], ...]
    owned: tuple[tuple[int, ...], ...]  # cache leaf indices (0-based within the cache) per stage
    carried: tuple[tuple, ...]  # carried[s]: the bundle keys from stage s to stage s + 1

    @property
    def n_stages(self) -> int:
        return len(self.graph.stages)


def trace_step(step: Callable, params, cache, tokens, positions, n_stages: int, name: str) -> StepSplit:
    """Trace `step` on these (abstract) arguments and cut it into `n_stages` stages."""
    closed, _, out_tree, _ = trace(_in_region(step), (params, cache, tokens, positions))
    paths = jax.tree_util.tree_flatten_with_path(cache)[0]
    slots = Slots(len(jax.tree.leaves(params)), tuple(jax.tree_util.keystr(p) for p, _ in paths))
    _check_outputs(out_tree, jax.tree.structure(cache), closed.out_avals, tokens, name)
    graph = split(closed, n_stages)
    if len(graph.stages) != n_stages:
        raise StageSplitError(
            f"{name}: the step's sxstage_iter markers cut it into {len(graph.stages)} stage(s); the mesh "
            f"and schedule need {n_stages} (pipeline ranks x virtual stages), i.e. {n_stages - 1} markers."
        )
    unchanged = _unchanged(closed.jaxpr, slots)
    graph = _read_only(graph, unchanged, slots)
    owned = _owners(graph, slots, unchanged, name)
    reads = [set(stage.arg_inputs) for stage in graph.stages]
    params_ = tuple(tuple(i for i in sorted(r) if i < slots.n_params) for r in reads)
    return StepSplit(graph, slots, params_, owned, _carried(graph, reads, slots))


def _in_region(step: Callable) -> Callable:
    def regioned(*args):
        with sxstage_region(REGION):
            return step(*args)

    return regioned


def _unchanged(jaxpr, slots: Slots) -> frozenset[int]:
    """The cache leaves (0-based within the cache) the step returns as it was given them."""
    n_cache = len(slots.names)
    return frozenset(c for c in range(n_cache) if jaxpr.outvars[1 + c] is jaxpr.invars[slots.n_params + c])


def _read_only(graph, unchanged: frozenset[int], slots: Slots):
    """`graph` without the unchanged cache leaves as results: a stage reads such a leaf only where
    one of its equations does."""
    if not unchanged:
        return graph
    stages = []
    for stage in graph.stages:
        used = {id(v) for eqn in stage.eqns for v in eqn.invars}
        args = tuple(
            i
            for i in stage.arg_inputs
            if slots.kind(i) != "cache" or i - slots.n_params not in unchanged or id(stage.invars[i]) in used
        )
        results = tuple(j for j in stage.results if j - 1 not in unchanged)
        stages.append(replace(stage, arg_inputs=args, results=results))
    return replace(graph, stages=tuple(stages))


def _check_outputs(out_tree, cache_tree, out_avals, tokens, name: str) -> None:
    expected = jax.tree.structure((0, jax.tree.unflatten(cache_tree, [0] * cache_tree.num_leaves)))
    if out_tree != expected:
        raise MpmdError(
            f"{name}: the step must return (logits, cache) with the cache's structure {cache_tree}; "
            f"it returned {out_tree}. Return the updated cache as the second result."
        )
    logits = out_avals[0]
    if logits.ndim != 3 or logits.shape[:2] != tokens.shape:
        raise MpmdError(
            f"{name}: the step's logits must be (batch, length, vocab) = {tuple(tokens.shape)} + (vocab,), "
            f"got {logits.shape}; return the logits of every input position."
        )


def _owners(graph, slots: Slots, unchanged: frozenset[int], name: str) -> tuple[tuple[int, ...], ...]:
    """Each stage's cache leaves; raises naming a leaf read or written by another stage. A leaf
    in `unchanged` belongs to every stage that reads it."""
    n_cache, last = len(slots.names), len(graph.stages) - 1
    if graph.result_stage[0] != last:
        raise MpmdError(
            f"{name}: the logits are computed in stage {graph.result_stage[0]}, not in the last stage "
            f"({last}); put every sxstage_iter marker before the model's head."
        )
    readers = {c: [] for c in range(n_cache)}
    for stage in graph.stages:
        for i in stage.arg_inputs:
            if slots.kind(i) == "cache":
                readers[i - slots.n_params].append(stage.index)
    owned: list[list[int]] = [[] for _ in graph.stages]
    for c in range(n_cache):
        if c in unchanged:
            for s in readers[c]:
                owned[s].append(c)
            continue
        writer = graph.result_stage[1 + c]
        bad = [s for s in readers[c] if s != writer]
        if bad:
            raise MpmdError(
                f"{name}: cache leaf cache{slots.names[c]} is read in stage {bad[0]} but written in stage "
                f"{writer}; each stage may read and write only its own part of the cache. Compute the "
                "leaf's new value in the stage that reads it (between the same sxstage_iter markers), "
                "or pass the value to later stages through the marker instead of the cache."
            )
        owned[writer].append(c)
    return tuple(tuple(o) for o in owned)


def _carried(graph, reads: list[set], slots: Slots) -> tuple[tuple, ...]:
    """The bundle keys crossing each boundary: edges from at or before it to after it, and the
    tokens while a later stage reads them."""
    out = []
    for s in range(len(graph.stages) - 1):
        keys = list(dict.fromkeys(e.var for e in graph.edges if e.src <= s < e.dst))
        if any(slots.tokens in r for r in reads[s + 1 :]):
            keys.append(TOKENS)
        out.append(tuple(keys))
    return tuple(out)


def run_stage(plan: StepSplit, s: int, weights: dict, cache: dict, tokens, positions, bundle: dict):
    """Evaluate stage `s`: `(bundle for stage s + 1, {cache leaf: new value}, logits or None)`.

    `weights` and `cache` map flat indices to values; `bundle` maps keys to values.
    """
    stage, slots = plan.graph.stages[s], plan.slots
    if s == 0:
        bundle = {TOKENS: tokens}
    tokens = bundle.get(TOKENS, tokens)
    values = {"tokens": tokens, "positions": positions}
    args = []
    for i in stage.arg_inputs:
        kind = slots.kind(i)
        args.append(
            weights[i] if kind == "param" else cache[i - slots.n_params] if kind == "cache" else values[kind]
        )
    outs, results = stage.run(args, [bundle[e.var] for e in stage.edge_inputs])
    made = dict(zip(stage.edge_outputs, outs))
    made.update(bundle)
    new_cache = {j - 1: v for j, v in zip(stage.results, results) if j > 0}
    new_cache.update((c, cache[c]) for c in plan.owned[s] if c not in new_cache)  # read-only leaves
    logits = results[stage.results.index(0)] if 0 in stage.results else None
    forward = {k: made[k] for k in plan.carried[s]} if s < plan.n_stages - 1 else {}
    return forward, new_cache, logits


def abstract(tree):
    """`tree` with every leaf a `ShapeDtypeStruct`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)
