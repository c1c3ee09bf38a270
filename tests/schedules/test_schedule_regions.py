"""RegionSchedule: several regions' tables merged into one, simulated with cross-region flow."""

import json

import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import Region, RegionSchedule, ScheduleError, region_labels

M = 4


def _chain_edges(stages):
    return tuple((a, b) for a, b in zip(stages, stages[1:]))


def two_towers(vision=S.GPipe(M), text=S.ZeroBubbleH1(M), meet=3):
    """Vision V0 → V1 on ranks 0, 1 (stages 0, 1); text T0 → T1 on ranks 2, 3 (stages 2, 3);
    stage `meet` of the text tower reads V1."""
    return RegionSchedule(
        (Region("vision", vision, (0, 1), (0, 1)), Region("text", text, (2, 3), (2, 3))),
        edges=((0, 1), (2, 3), (1, meet)),
    )


@pytest.mark.parametrize("cls", S.ALL_SCHEDULES, ids=lambda c: c.__name__)
def test_one_region_is_the_schedule_itself(cls):
    """A single region over a chain simulates exactly as the bare schedule does."""
    n = 2
    schedule = cls(microbatches=8)
    stages = tuple(range(schedule.num_stages(n)))
    merged = RegionSchedule((Region("main", schedule, (0, 1), stages),), edges=_chain_edges(stages))
    for s in stages:
        assert merged.rank_of(s, n) == schedule.rank_of(s, n)
    assert merged.actions(n) == schedule.actions(n)
    got, want = S.simulate(merged, n), S.simulate(schedule, n)
    assert (got.makespan, got.busy, got.peak_activations) == (want.makespan, want.busy, want.peak_activations)
    assert got.stage_labels == tuple(f"M{s}" for s in stages)


def test_towers_run_side_by_side_and_meet_where_the_text_reads_vision():
    merged = two_towers()
    t = S.simulate(merged, 4)
    events = {
        (e.cell.parts[0].kind, e.cell.parts[0].stage, e.cell.parts[0].microbatch): e
        for row in t.events
        for e in row
    }
    # the text tower's first stage does not wait for vision; its second waits for V1's forward
    assert events["F", 2, 0].start == 0
    assert events["F", 3, 0].start >= events["F", 1, 0].end
    # vision's backward waits for the gradient the text stage sends back
    assert events["B", 1, 0].start >= events["I", 3, 0].end
    grid = S.render_grid(t)
    assert "V1F3" in grid and "T0W2" in grid and "T1I0" in grid
    trace = S.chrome_trace(t)
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"V0F0", "T1W3"} <= names
    json.dumps(trace)


def test_side_by_side_towers_beat_one_linear_chain_of_the_same_stages():
    merged = two_towers(vision=S.Std1F1B(M), text=S.Std1F1B(M))
    regions, chain = S.simulate(merged, 4), S.simulate(S.Std1F1B(M), 4)
    assert regions.makespan < chain.makespan
    assert regions.bubble_fraction < chain.bubble_fraction


def test_regions_may_share_ranks():
    merged = RegionSchedule(
        (
            Region("audio", S.GPipe(M), (0,), (0,)),
            Region("vision", S.GPipe(M), (0,), (1,)),
            Region("text", S.Std1F1B(M), (1, 2), (2, 3)),
        ),
        edges=((2, 3), (0, 3), (1, 3)),
    )
    assert merged.stages_of(0, 3) == (0, 1) and merged.virtual_stages == 2
    rows = merged.actions(3)
    assert len(rows[0]) == 4 * M  # audio's and vision's cells, interleaved on rank 0
    t = S.simulate(merged, 3)
    assert t.busy[0] == pytest.approx(2 * M * 3)
    assert S.render_grid(t).startswith("rank 0 | A0F0 V0F0")


def test_stage_costs_apply_to_region_stages():
    cost = S.StageCost(F=(1, 1, 3, 3), B=(2, 2, 6, 6), I=(1, 1, 3, 3), W=(1, 1, 3, 3))
    t = S.simulate(two_towers(), 4, cost)
    assert t.busy[2] == pytest.approx(M * (3 + 3 + 3))
    assert t.busy[0] == pytest.approx(M * (1 + 2))


def test_labels_are_shortest_unique_prefixes():
    assert region_labels(("vision", "text")) == ("V", "T")
    assert region_labels(("text", "tokens", "audio")) == ("TE", "TO", "A")


@pytest.mark.parametrize(
    "upstream",
    [S.Std1F1B(M), S.ZeroBubbleH1(M), S.InterleavedH1(M, virtual_stages=2), S.KimiK2(M, virtual_stages=2)],
)
def test_forwards_overtake_a_backward_that_waits_on_another_region(upstream):
    """Text runs GPipe: no gradient comes back before its last forward, so the vision tower's
    1F1B-style backwards would wait forever; its forwards move ahead of them instead."""
    ranks = (0, 1) if upstream.layout == "flat" else (0,)
    vision = tuple(range(upstream.num_stages(len(ranks))))
    k, r = len(vision), len(ranks)
    merged = RegionSchedule(
        (Region("vision", upstream, ranks, vision), Region("text", S.GPipe(M), (r, r + 1), (k, k + 1))),
        edges=(*_chain_edges(vision), (k, k + 1), (vision[-1], k)),
    )
    t = S.simulate(merged, r + 2)
    last_row = [a for cell in merged.actions(r + 2)[merged.rank_of(vision[-1], r + 2)] for a in cell.parts]
    last_forward = max(i for i, a in enumerate(last_row) if a.kind == "F" and a.stage == vision[-1])
    first_backward = min(i for i, a in enumerate(last_row) if a.kind in "BI" and a.stage == vision[-1])
    assert last_forward < first_backward
    assert t.makespan > 0


@pytest.mark.parametrize(
    "regions, edges, message",
    [
        (
            (Region("v", S.GPipe(2), (0,), (0,)), Region("v", S.GPipe(2), (1,), (1,))),
            (),
            r"region name\(s\) \['v'\] used more than once",
        ),
        (
            (Region("v", S.GPipe(2), (0,), (0,)), Region("t", S.GPipe(4), (1,), (1,))),
            (),
            r"same number of microbatches.*\{'v': 2, 't': 4\}",
        ),
        (
            (Region("v", S.GPipe(2), (0,), (0, 1)), Region("t", S.GPipe(2), (1,), (2,))),
            (),
            r"region 'v' has 2 stage\(s\), but GPipe.* on its 1 rank\(s\) runs 1",
        ),
        (
            (Region("v", S.DualPipeV(1), (0,), (0, 1)), Region("t", S.GPipe(1), (1,), (2,))),
            (),
            r"region 'v': its schedule is not valid on 1 rank\(s\)",
        ),
        (
            (Region("v", S.GPipe(2), (0,), (0,)), Region("t", S.GPipe(2), (2,), (1,))),
            (),
            r"ranks 0\.\.k without gaps",
        ),
        (
            (Region("v", S.GPipe(2), (0, 1), (0, 1)), Region("t", S.GPipe(2), (2,), (2,))),
            ((0, 1), (1, 2), (2, 0)),
            r"cycle \(V1 -> T0 -> V0 -> V1\)",
        ),
    ],
)
def test_bad_regions_are_clear_errors(regions, edges, message):
    with pytest.raises(ScheduleError, match=message):
        RegionSchedule(regions, edges)


def test_peak_bytes_are_not_modelled_for_region_graphs():
    per_stage, per_rank = (1, 1, 1, 1), (0, 0, 0, 0)
    memory = S.StageMemory(
        inputs=per_stage,
        kept_inputs=per_stage,
        residuals=per_stage,
        grads=per_stage,
        stash=per_stage,
        params=per_rank,
        accumulators=per_rank,
        optimizer=per_rank,
        other=per_rank,
    )
    with pytest.raises(ValueError, match=r"peak bytes \(memory=\) are modelled for a chain of stages"):
        S.simulate(two_towers(), 4, memory=memory)
