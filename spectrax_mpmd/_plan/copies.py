"""The graph of a schedule's logical stages: the traced stage graph, with a stage cluster run
twice where the schedule runs copies of a model stage (DualPipe's two directions).

Logical stage `s` runs model stage `schedule.model_stage(s, n)` on the microbatches
`schedule.microbatches_of(s, n)`. Each copy is the model stage's cluster with its
own edges: a copy reads from the copies of its source stages that run the same
microbatches, so each group of microbatches flows through its own copies. A
parameter leaf read by several copies is then an ordinary shared leaf: placed on
each reader's rank, its gradients summed on its first reader (`reduce_gradients`).
"""

from __future__ import annotations

import dataclasses

from .._trace.graph import Edge, StageGraph
from ..errors import StageSplitError


def model_stages(schedule, n: int, stages: int) -> tuple[int, ...]:
    """The model stage each logical stage of `schedule` runs on `n` ranks (`stages` traced
    stages; the identity for a schedule that runs each stage once)."""
    if not hasattr(schedule, "model_stage"):
        return tuple(range(stages))
    model = tuple(schedule.model_stage(s, n) for s in range(schedule.num_stages(n)))
    if sorted(set(model)) != list(range(stages)):
        raise StageSplitError(
            f"schedule {type(schedule).__name__} on {n} ranks runs {len(set(model))} model stage(s) "
            f"({len(model)} logical stages), but the function has {stages} stage(s); give it "
            f"{len(set(model)) - 1} sxstage_iter marker(s)."
        )
    return model


def copy_stages(graph: StageGraph, schedule, n: int) -> tuple[StageGraph, tuple[int, ...]]:
    """`(the graph of the logical stages, the model stage of each)`; `graph` itself when every
    logical stage is its own model stage. An output of a copied stage is gathered on the
    rank of its last copy (`result_stage`)."""
    model = model_stages(schedule, n, len(graph.stages))
    if model == tuple(range(len(graph.stages))):
        return graph, model
    runs = [tuple(schedule.microbatches_of(s, n)) for s in range(len(model))]
    edges: dict = {}
    for d, md in enumerate(model):
        for e in graph.stages[md].edge_inputs:
            src = [c for c, mc in enumerate(model) if mc == e.src and runs[c] == runs[d]]
            if len(src) != 1:
                raise StageSplitError(
                    f"schedule {type(schedule).__name__}: logical stage {d} (a copy of model stage {md}) "
                    f"needs one copy of model stage {e.src} running the same microbatches, found "
                    f"{len(src)}; each group of microbatches must flow through its own copies."
                )
            edges[(e, d)] = Edge(e.var, src[0], d, e.spec)
    stages = tuple(
        dataclasses.replace(
            graph.stages[md], index=s, edge_inputs=tuple(edges[(e, s)] for e in graph.stages[md].edge_inputs)
        )
        for s, md in enumerate(model)
    )
    last_copy = {md: s for s, md in enumerate(model)}
    logical = dataclasses.replace(
        graph,
        stages=stages,
        edges=tuple(edges.values()),
        result_stage=tuple(last_copy[t] for t in graph.result_stage),
        stage_regions=tuple(graph.stage_regions[md] for md in model) if graph.stage_regions else (),
    )
    return logical, model
