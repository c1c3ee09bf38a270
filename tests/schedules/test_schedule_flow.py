"""`Flow` (what each cell waits for) and `issue_order` (the one walk over a table)."""

import itertools
from collections import namedtuple
from dataclasses import replace

import jax.numpy as jnp
import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import (
    Action,
    DeadlockError,
    Dependency,
    Flow,
    FusedAction,
    ScheduleError,
    issue_order,
)


def cells(text):
    """Rows of cells from `repr` strings ('0F1', '1F0&1B2')."""

    def one(word):
        if "&" in word:
            return FusedAction(tuple(one(p) for p in word.split("&")))
        kind = next(k for k in "FBIW" if k in word)
        stage, mb = word.split(kind)
        return Action(kind, int(stage), int(mb))

    return [[one(w) for w in line.split()] for line in text.strip().splitlines()]


def reference_order(table, flow):
    """The plain round-robin written out: every round visits each rank once, in rank order,
    and issues its next cell when what it reads is issued. None when a round issues nothing."""
    done, pos, order = set(), [0] * len(table), []

    def grad(t, i):
        return ("B", t, i) in done or ("I", t, i) in done

    def ready(a):
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            return all(("F", p, i) in done for p in flow.inputs[s])
        if a.kind == "W":
            return ("I", s, i) in done
        return ("F", s, i) in done and all(grad(c, i) for c in flow.gradient_inputs[s])

    while any(p < len(row) for p, row in zip(pos, table)):
        issued = False
        for r, row in enumerate(table):
            if pos[r] < len(row) and all(ready(a) for a in row[pos[r]].parts):
                done.update((a.kind, a.stage, a.microbatch) for a in row[pos[r]].parts)
                order.append((r, row[pos[r]]))
                pos[r] += 1
                issued = True
        if not issued:
            return None
    return order


# --- Flow -----------------------------------------------------------------------------------


def test_chain_reads_the_stage_before_and_waits_for_the_stage_after():
    flow = Flow.chain(4)
    assert flow.inputs == ((), (0,), (1,), (2,))
    assert flow.gradient_inputs == ((1,), (2,), (3,), ())
    assert flow.stages == 4 and flow.is_chain and Flow.chain(0).stages == 0


@pytest.mark.parametrize("cls", S.ALL_SCHEDULES, ids=lambda c: c.__name__)
def test_every_schedule_flows_along_its_logical_chain(cls):
    """Loop and V layouts too: the flow follows the logical stages 0..S-1, not the ranks."""
    for n in (1, 2, 4):
        schedule = cls(microbatches=2 * n)
        flow = schedule.flow(n)
        assert flow == Flow.chain(schedule.num_stages(n))
        assert flow.inputs == schedule.stage_inputs(n)
        assert flow.gradient_inputs == schedule.gradient_inputs(n)


def test_from_edges_with_a_skip_connection_and_a_forward_only_edge():
    # 0 -> 1 -> 2 -> 3, a skip 0 -> 3, and 1 -> 3 that carries no gradient (an integer index)
    edges = ((0, 1), (1, 2), (2, 3), (0, 3), (1, 3))
    flow = Flow.from_edges(4, edges, gradient_edges=[e for e in edges if e != (1, 3)])
    assert flow.inputs == ((), (0,), (1,), (0, 1, 2))
    assert flow.gradient_inputs == ((1, 3), (2,), (3,), ())
    assert not flow.is_chain
    D = Dependency
    assert flow.needs(Action("F", 3, 5)) == (D("F", 0, 5), D("F", 1, 5), D("F", 2, 5))
    assert flow.needs(Action("B", 0, 2)) == (D("F", 0, 2), D("G", 1, 2), D("G", 3, 2))
    assert flow.needs(Action("I", 1, 0)) == (Dependency("F", 1, 0), Dependency("G", 2, 0))
    assert flow.needs(Action("W", 1, 0)) == (Dependency("G", 1, 0),)
    # by default every edge carries a gradient; repeated edges count once
    assert Flow.from_edges(4, edges + ((0, 1),)).gradient_inputs == ((1, 3), (2, 3), (3,), ())


def test_makes_b_and_i_both_provide_the_input_gradient():
    assert Flow.makes(Action("B", 2, 1)) == Flow.makes(Action("I", 2, 1)) == Dependency("G", 2, 1)
    assert Flow.makes(Action("F", 2, 1)) == Dependency("F", 2, 1)
    assert str(Dependency("G", 2, 1)) == "the input gradient of stage 2, microbatch 1"


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Flow.from_edges(3, [(0, 3)]), r"edges holds \(0, 3\); .* stages in 0..2"),
        (lambda: Flow.from_edges(3, [(1, 1)]), r"edges holds \(1, 1\); .* two different stages"),
        (lambda: Flow.from_edges(3, [(0, 1)], gradient_edges=[(0, 1, 2)]), "gradient_edges holds"),
        (lambda: Flow.chain(-1), "stages must be a non-negative int"),
        (lambda: Flow(((), (0,)), ((1,),)), "inputs has 2 stage.* gradient_inputs has 1"),
        (lambda: Flow(((), (5,)), ((), ())), r"inputs\[1\] names stage 5"),
    ],
)
def test_bad_flows_are_clear_errors(build, message):
    with pytest.raises(ScheduleError, match=message):
        build()


def test_the_runtime_stage_graph_gives_its_flow():
    """A traced function with a skip connection (1 -> 3) and an integer-only edge (2 -> 4)."""
    from spectrax_mpmd import sxstage_iter
    from spectrax_mpmd._trace.split import split, trace

    def f(x):
        h1 = sxstage_iter(x * 2.0)
        h2 = sxstage_iter(jnp.sin(h1))
        idx = jnp.argmax(h2)
        h3 = sxstage_iter(jnp.cos(h2))
        h4 = sxstage_iter(h3 * h1)
        return jnp.sum(h4) + h4.reshape(-1)[idx]

    graph = split(trace(f, (jnp.ones((2, 3)),))[0], 5)
    pairs = {(e.src, e.dst): e.differentiable for e in graph.edges}
    assert pairs[1, 3] and not pairs[2, 4]  # the case this test is about
    flow = graph.flow()
    for s in range(5):
        assert flow.inputs[s] == tuple(sorted({e.src for e in graph.edges if e.dst == s}))
        assert flow.gradient_inputs[s] == tuple(
            sorted({e.dst for e in graph.edges if e.src == s and e.differentiable})
        )
    assert 2 in flow.inputs[4] and 4 not in flow.gradient_inputs[2]


# --- issue_order ---------------------------------------------------------------------------


FLOWS = {
    "chain": lambda k: Flow.chain(k),
    "skips": lambda k: Flow.from_edges(k, [(s, s + 1) for s in range(k - 1)] + [(0, k - 1), (1, k - 1)]),
    "forward-only skips": lambda k: Flow.from_edges(
        k,
        [(s, s + 1) for s in range(k - 1)] + [(0, k - 1), (1, k - 1)],
        [(s, s + 1) for s in range(k - 1)],
    ),
}


@pytest.mark.parametrize("flow_name", FLOWS)
@pytest.mark.parametrize("cls", S.ALL_SCHEDULES, ids=lambda c: c.__name__)
def test_issue_order_is_the_plain_round_robin(cls, flow_name):
    for n, m in itertools.product((1, 2, 3, 4), (1, 3, 8)):
        schedule = cls(microbatches=max(m, 2 * n if cls is S.DualPipeV else n))
        table = schedule.actions(n)
        flow = FLOWS[flow_name](schedule.num_stages(n)) if schedule.num_stages(n) > 2 else schedule.flow(n)
        want = reference_order(table, flow)
        assert want is not None  # every schedule runs on these graphs
        got = issue_order(table, flow)
        assert got == want
        assert [[c for r, c in got if r == rank] for rank in range(n)] == [list(row) for row in table]


def test_a_fused_cell_waits_for_both_parts():
    flow = Flow.chain(2)
    # rank 1's 1F1&1B0 needs 0F1 (forward part) and 1F0 (backward part)
    table = cells("0F0 0F1 0B0 0B1\n1F0 1F1&1B0 1B1")
    order = [(r, repr(c)) for r, c in issue_order(table, flow)]
    assert order.index((1, "1F1&1B0")) > order.index((0, "0F1"))
    # a part waiting on the other part of its own cell can never run
    waits = r"rank 1 at cell 1 \(1F1&1B1\) waits for the forward of stage 1, microbatch 1"
    with pytest.raises(DeadlockError, match=waits):
        issue_order(cells("0F0 0F1 0B0 0B1\n1F0 1F1&1B1 1B0"), flow)


def test_a_stalled_table_names_each_stuck_rank_and_what_it_waits_for():
    table = cells("0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1")
    with pytest.raises(DeadlockError) as info:
        issue_order(table, Flow.chain(2))
    err = info.value
    assert isinstance(err, ScheduleError) and isinstance(err, ValueError)
    assert [(s.rank, s.index, repr(s.cell), s.waits_for) for s in err.stuck] == [
        (0, 1, "0B0", Dependency("G", 1, 0)),
        (1, 0, "1F1", Dependency("F", 0, 1)),
    ]
    assert "rank 0 at cell 1 (0B0) waits for the input gradient of stage 1, microbatch 0" in str(err)
    assert "rank 1 at cell 0 (1F1) waits for the forward of stage 0, microbatch 1" in str(err)


def test_queues_may_share_a_rank():
    # two queues on rank 0 (stages 0 and 1), one on rank 1 (stage 2): a chain
    queues = cells("0F0 0B0\n1F0 1B0\n2F0 2B0")
    order = issue_order(queues, Flow.chain(3), ranks=(0, 0, 1))
    assert [(r, repr(c)) for r, c in order] == [
        (0, "0F0"),
        (0, "1F0"),
        (1, "2F0"),
        (1, "2B0"),
        (0, "1B0"),
        (0, "0B0"),
    ]
    with pytest.raises(ScheduleError, match="ranks has 2 entries for 3 queues"):
        issue_order(queues, Flow.chain(3), ranks=(0, 1))


def test_unblock_reorders_a_stalled_walk():
    table = cells("0F0 0B0 0F1 0B1\n1B0 1F0 1F1 1B1")
    seen = []

    def swap_rank_one(left, ready):
        seen.append((tuple(map(len, left)), ready(Action("F", 1, 0)), ready(Action("F", 1, 1))))
        return (left[0], (left[1][1], left[1][0], *left[1][2:]))

    order = issue_order(table, Flow.chain(2), unblock=swap_rank_one)
    assert seen == [((3, 4), True, False)]
    assert [repr(c) for r, c in order if r == 1] == ["1F0", "1B0", "1F1", "1B1"]
    with pytest.raises(DeadlockError, match="rank 1 at cell 0"):
        issue_order(table, Flow.chain(2), unblock=lambda left, ready: None)
    with pytest.raises(ScheduleError, match="unblock must return one queue per queue given"):
        issue_order(table, Flow.chain(2), unblock=lambda left, ready: left)


def test_cells_beyond_the_flow_are_an_error():
    with pytest.raises(ScheduleError, match=r"queue 1 holds 2F0, but the flow has 2 stage"):
        issue_order(cells("0F0 0B0\n2F0 2B0"), Flow.chain(2))


def test_every_stall_is_one_error_type():
    """The simulator, the memory model and the MPMD issue order raise `DeadlockError`."""
    from spectrax_mpmd._plan.order import order_actions
    from spectrax_mpmd._trace.split import StageGraph
    from spectrax_mpmd.errors import StageSplitError

    Edge = namedtuple("Edge", "src dst differentiable")
    loop = tuple(Edge(s, (s + 1) % 3, True) for s in range(3))  # a cycle: nothing can start
    graph = StageGraph(stages=(None,) * 3, edges=loop, in_avals=(), out_avals=(), result_stage=())
    stuck = r"no rank can proceed \(next actions \{0: 'F0', 1: 'F0', 2: 'F0'\}\)"
    with pytest.raises(StageSplitError, match=stuck) as info:
        order_actions(S.GPipe(2), 3, graph)
    assert isinstance(info.value, DeadlockError) and len(info.value.stuck) == 3

    timeline = S.simulate(S.GPipe(2), 2)
    swapped = replace(timeline, events=(timeline.events[0], timeline.events[1][::-1]))
    memory = S.StageMemory(*(((1, 1),) * 9))
    with pytest.raises(DeadlockError, match="cannot be issued in table order"):
        S.peak_bytes(swapped, memory)


def test_edges_may_be_lists():
    assert Flow.from_edges(3, [[0, 1], [1, 2]]) == Flow.chain(3)
