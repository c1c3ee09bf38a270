"""The plan of a forward call (`sxjit`): stages in order, or microbatches in the schedule's forward order."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp

from ._cells import StageCells
from ._compile import CellSpec, Compiler, _sds
from ._mesh import MpmdMesh
from ._order import order_actions
from ._plan import Plan, TrainPlanBuilder
from ._split import StageGraph
from .errors import StageSplitError


class _Layout:
    """The trivial stage layout used when no schedule is given: stage s on rank s."""

    microbatches = 1
    virtual_stages = 1

    def rank_of(self, stage: int, n: int) -> int:
        return stage


class ForwardPlanBuilder(TrainPlanBuilder):
    """Builds the plan of a forward call (`sxjit`).

    Without microbatches: every stage once, in stage order, on the whole batch.
    With `microbatches > 1`: the batch arguments are split, each microbatch runs
    through the stages in the schedule's forward order (its F actions), and
    every output is concatenated back in batch order.
    """

    def __init__(
        self,
        graph: StageGraph,
        schedule,
        mesh: MpmdMesh,
        *,
        compiler: Compiler,
        donated: frozenset = frozenset(),
        batch_args: Sequence[int] = (),
        batch_avals: dict | None = None,
        keys: frozenset = frozenset(),
    ):
        layout = schedule if schedule is not None else _Layout()
        self.donated = donated
        super().__init__(
            graph,
            layout,
            mesh,
            diff_args=(),
            batch_args=batch_args,
            batch_avals=batch_avals or {},
            param_specs={},
            remat=False,
            compiler=compiler,
            keys=keys,
            require_loss=False,
        )
        if not batch_args:
            self.m = 1

    def _donatable(self, s: int) -> tuple[int, ...]:
        """Input positions of stage `s` that may be donated: donated leaves read by this stage only."""
        readers: dict[int, int] = {}
        for io in self.ios:
            for a in io.fixed:
                readers[a] = readers.get(a, 0) + 1
        return tuple(k for k, a in enumerate(self.ios[s].fixed) if a in self.donated and readers[a] == 1)

    def _forward_order(self) -> list[tuple[int, int, int]]:
        """`(rank, stage, microbatch)` of every forward, in issue order."""
        if self.m == 1:
            return [(self.rank[s], s, 0) for s in range(len(self.ios))]
        return [
            (rank, p.stage, p.microbatch)
            for rank, action in order_actions(self.schedule, self.n, self.g)
            for p in action.parts
            if p.kind == "F"
        ]

    def build(self) -> Plan:
        self.cells = [StageCells(io, self.m, False, self.input_specs(s)) for s, io in enumerate(self.ios)]
        self.edge_index = {e: k for k, e in enumerate(self.g.edges)}
        results: dict = {}
        for rank, s, i in self._forward_order():
            cell = self._forward_spec(
                s, keep_residuals=False, donate=self._donatable(s) if self.m == 1 else ()
            )
            start = len(self.steps)
            results.update(
                ((j, i), slot)
                for j, slot in zip(self.ios[s].stage.results, self._emit_forward(cell, s, i, 0))
            )
            self.plan.log.append((rank, ("F", s, i), "F"))
            self.plan.action_steps.append((rank, ("F", s, i), start, len(self.steps)))
        outputs = [
            self._batch_order(j, [results[j, i] for i in range(self.m)]) for j in range(len(self.g.out_avals))
        ]
        self.plan.output_slots = {"results": outputs}
        self._seal(set(outputs))
        return self.plan

    def _batch_order(self, j: int, slots: list[int]) -> int:
        """Output `j` of every microbatch, concatenated along the leading (batch) axis."""
        if len(slots) == 1:
            return slots[0]
        aval = self.g.out_avals[j]
        if not aval.shape:
            raise StageSplitError(
                f"a forward over {self.m} microbatches returns its outputs in batch order, so each "
                f"output needs a leading batch axis; output {j} is a scalar ({aval.str_short()}). "
                "Return per-example values, or run without microbatches."
            )
        sh = self.named(self.g.result_stage[j], None)
        concat = CellSpec(_concat, (_sds(aval, sh),) * self.m, (sh,))
        out = self.slots.new()
        self.steps.append((concat, tuple(slots), (out,), ()))
        return out


def _concat(*xs):
    return (jnp.concatenate(xs, axis=0),)
