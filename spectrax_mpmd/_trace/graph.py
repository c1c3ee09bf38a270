"""The stage graph a traced function is cut into: stages (clusters of equations), and the
edges carrying values between them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from spectrax_core.schedules import Flow

from .jax_private import JaxprEqn, Var
from .jaxpr import eval_eqns, read
from .marker import sxstage_iter_p
from .region import DEFAULT_REGION


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

        Returns `(edge_output_values, result_values)`. A stage marker the stage holds is the
        identity here (the split has used it): what passes through it keeps its identity, so a
        received value the backward needs is read from its own buffer, not returned by the
        forward as a copy (`StageCells.residual_sources`).
        """
        env = dict(self.consts)
        env.update(zip((self.invars[i] for i in self.arg_inputs), args))
        env.update(zip((e.var for e in self.edge_inputs), edges))
        eval_eqns(self.eqns, env, identities=(sxstage_iter_p.name,))
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
