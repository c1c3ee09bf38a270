"""The zero-bubble family, DualPipe, hand-written tables and the searched schedule.

Figures are checked against the published ones at T_F = T_I = T_W = 1 (T_B = 2): ZB-H2
and ZB-V have no idle inside a rank's busy span beyond the pipeline's fill, V-Half and
V-Min hold the published memory, DualPipe matches DeepSeek's bubble and memory.
"""

import io
import json

import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import Cost, DeadlockError, ScheduleError, simulate


def inner_idle(timeline) -> list[float]:
    """Per rank, idle time between its first cell's start and its last cell's end."""
    return [(row[-1].end - row[0].start) - sum(e.end - e.start for e in row) for row in timeline.events]


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("k", [2, 4])
def test_zb_h2_has_no_bubble_inside_the_fill_parallelogram(n, k):
    m = k * n
    t = simulate(S.ZeroBubbleH2(m), n)
    assert inner_idle(t) == [0.0] * n
    assert t.makespan == 3 * m + n - 1  # rank r is busy from r to 3m + r
    assert [row[0].start for row in t.events] == list(range(n))
    assert max(t.peak_activations) == 2 * n - 1  # the published (2p - 1) M_B


@pytest.mark.parametrize("latency", [0.5, 1.0])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_zb_h2_latency_variants_stay_bubble_free_under_their_transfer_time(n, latency):
    m = 4 * n
    built = S.ZeroBubbleH2(m, latency=latency)
    t = simulate(built, n, Cost(comm=latency))
    assert inner_idle(t) == [0.0] * n
    plain = simulate(S.ZeroBubbleH2(m), n, Cost(comm=latency))
    assert t.makespan <= plain.makespan
    assert max(t.peak_activations) <= built.activation_cap(n)


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_zbv_makespan_is_work_plus_fill_with_1f1b_memory(n):
    for m in (2 * n, 4 * n):
        t = S.ZBV(m).timeline(n)
        assert t.makespan == 6 * m + n - 1  # chunk cells: 6m of work, n - 1 of fill
        assert max(t.peak_activations) <= 2 * n  # 1F1B's n whole-rank activations
    # steady state: two more rounds of n microbatches cost exactly their work
    assert S.ZBV(4 * n).total_steps(n) - S.ZBV(2 * n).total_steps(n) == 6 * 2 * n


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("k", [2, 4])
def test_v_half_and_v_min_hold_the_published_memory(n, k):
    m = k * n
    half, least = S.VHalf(m), S.VMin(m)
    assert half.peak_activations(n) <= 2 * ((n + 2) // 2)  # (p + 2) // 2 whole-rank activations
    assert least.peak_activations(n) <= 2 * ((n + 4) // 3)  # (p + 4) // 3
    assert half.bubble_ratio(n) <= n / (2 * m)  # published: about p / 2m
    one_f_one_b = S.Std1F1B(m)
    assert half.bubble_ratio(n) < one_f_one_b.bubble_ratio(n)
    assert least.bubble_ratio(n) <= 2 * n / (3 * m)  # published: about 2p / 3m
    # published V-Min bubble (2p/3)(T_F + T_B + T_W) = 4n chunk cells per rank; the block
    # repeats every 6 cells, so it is the bubble to within one block's slack
    assert 4 * n - 6 <= max(least.timeline(n).idle) <= 4 * n


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_v_min_has_no_bubble_in_its_steady_state(n):
    """Two more rounds of n microbatches cost exactly their work (6 chunk cells each)."""
    assert S.VMin(4 * n).total_steps(n) - S.VMin(2 * n).total_steps(n) == 6 * 2 * n


@pytest.mark.parametrize("cls", S.MORE_SCHEDULES, ids=lambda c: c.__name__)
def test_figures_equal_the_simulation_and_tables_round_trip_as_text(cls):
    for n in (2, 4):
        for m in (2 * n, 3 * n + 2):
            s = cls(microbatches=m)
            t = simulate(s, n, Cost())
            assert s.total_steps(n) == t.makespan and s.bubble_ratio(n) == t.bubble_fraction
            assert s.peak_activations(n) == max(t.peak_activations)
            assert S.parse_table(S.format_table(s.actions(n)), s) == s.actions(n)
            S.render_grid(t)
            trace = S.chrome_trace(t)
            assert len([e for e in trace["traceEvents"] if e.get("ph") == "X"]) == sum(map(len, t.events))
            json.dumps(trace)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("fb", [3.0, 2.5, 2.0])
def test_dualpipe_matches_deepseeks_bubble_and_memory(n, fb):
    for m in (2 * n, 4 * n):
        s = S.DualPipe(m)
        t = simulate(s, n, Cost(FB=fb))
        assert max(t.idle) == (n // 2 - 1) * (fb + 2 - 3)  # (PP/2 - 1)(F&B + B - 3W), PP = n
        assert max(S.DualPipe(m).timeline(n).peak_activations) == n + 1  # PP + 1
        v = simulate(S.DualPipeV(m // 2), n // 2, Cost(FB=fb))
        assert t.makespan == v.makespan  # each pair of mirrored ranks runs DualPipeV's order


def test_dualpipe_feeds_half_the_microbatches_from_each_end():
    n, m = 4, 8
    s = S.DualPipe(m)
    for stage in range(2 * n):
        ran = {a.microbatch for row in s.actions(n) for c in row for a in c.parts if a.stage == stage}
        assert ran == set(s.microbatches_of(stage, n))
        assert s.model_stage(stage, n) == stage % n
    assert s.rank_of(0, n) == 0 and s.rank_of(n, n) == n - 1  # model stage 0 at both ends
    assert s.flow(n).inputs[n] == () and s.flow(n).gradient_inputs[n - 1] == ()


@pytest.mark.parametrize(
    "n, m, rule",
    [(3, 6, "even number of ranks"), (4, 7, "even microbatches"), (4, 6, "smallest valid microbatches is 8")],
)
def test_dualpipe_rejects_what_it_cannot_run(n, m, rule):
    with pytest.raises(ScheduleError, match=rule):
        S.DualPipe(m).actions(n)


def test_user_tables_from_rows_text_and_csv_are_one_schedule():
    reference = S.Std1F1B(5)
    text = S.format_table(reference.actions(3))
    from_text = S.UserSchedule.from_text(text)
    from_csv = S.UserSchedule.from_csv(io.StringIO(text.replace(" ", ",")))
    from_rows = S.UserSchedule([line.split() for line in text.splitlines()])
    assert from_text == from_csv == from_rows
    assert from_text.actions(3) == reference.actions(3)
    assert (from_text.microbatches, from_text.virtual_stages) == (5, 1)
    assert simulate(from_text, 3).makespan == reference.total_steps(3)
    v = S.UserSchedule.from_text(S.format_table(S.ZBV(6).actions(2)))
    assert v.stages_of(0, 2) == (0, 3) and v.splits_backward
    assert v.total_steps(2) == S.ZBV(6).total_steps(2)


@pytest.mark.parametrize(
    "text, error, names",
    [
        ("0F0 0B0 0B0\n1F0 1B0", ScheduleError, r"rank 0 cell 2 \(0B0\) appears twice"),
        ("0F0 0B0\n1B0 1F0", ScheduleError, "F at rank 1 cell 1, B/I at cell 0"),
        ("0F0 0B0\n1F0", ScheduleError, r"\(stage 1, microbatch 0\) has backward actions \[\]"),
        ("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0", DeadlockError, r"rank 0 at cell 1 \(0B0\) waits for"),
        ("0F0 0B0 1F0\n1B0", ScheduleError, "stage 1 appears on ranks"),
        ("0F0 0X0", ScheduleError, "rank 0 cell 1"),
    ],
)
def test_invalid_user_tables_name_the_first_offending_action(text, error, names):
    with pytest.raises(error, match=names):
        S.UserSchedule.from_text(text)


def test_a_user_table_runs_on_its_own_number_of_ranks_only():
    s = S.UserSchedule.from_text("0F0 0B0\n1F0 1B0")
    with pytest.raises(ScheduleError, match="2 rows"):
        s.actions(3)


def lm_cost(n):
    """An LM cut: a light embedding stage, uniform blocks, a heavy head and loss."""
    f = (0.3,) + (1.0,) * (n - 2) + (2.5,)
    return S.StageCost(f, tuple(2 * x for x in f), f, f)


def skewed_cost(n):
    """Embedding and head heavier than the blocks, weight gradients cheaper than input ones."""
    f = (2.0,) + (1.0,) * (n - 2) + (3.0,)
    return S.StageCost(f, tuple(2 * x for x in f), f, tuple(0.8 * x for x in f))


NAMED_FLAT = (S.GPipe, S.Std1F1B, S.Eager1F1B, S.ZeroBubbleH1, S.ZeroBubbleH2)


@pytest.mark.parametrize("make_cost", [lm_cost, skewed_cost, lambda n: Cost(comm=0.5)])
@pytest.mark.parametrize("n, m, budget", [(4, 8, 4), (4, 8, None), (8, 16, 10)])
def test_search_beats_or_ties_every_named_schedule_within_the_budget(make_cost, n, m, budget):
    cost = make_cost(n)
    found = S.search(n, m, cost, memory_budget=budget)
    got = simulate(found, n, cost)
    assert budget is None or max(got.peak_activations) <= budget
    for cls in NAMED_FLAT:
        t = simulate(cls(microbatches=m), n, cost)
        if budget is None or max(t.peak_activations) <= budget:
            assert got.makespan <= t.makespan, cls.__name__


def test_search_on_a_v_cut_and_its_errors():
    n, m = 4, 8
    f = (0.3,) + (1.0,) * (2 * n - 2) + (2.5,)
    cost = S.StageCost(f, tuple(2 * x for x in f), f, f)
    found = S.search(n, m, cost, virtual_stages=2)
    for cls in (S.DualPipeV, S.ZBV, S.VHalf, S.VMin):
        assert simulate(found, n, cost).makespan <= simulate(cls(m), n, cost).makespan
    with pytest.raises(ScheduleError, match="one duration per stage"):
        S.search(n, m, cost)
    with pytest.raises(ScheduleError, match="smallest peak found is 2"):
        S.search(n, m, Cost(), memory_budget=1, virtual_stages=2)


def test_a_searched_table_is_a_user_table():
    found = S.search(4, 8, Cost(F=1, B=2, I=1.5, W=0.5, comm=0.25))
    again = S.UserSchedule.from_text(S.format_table(found.actions(4)))
    assert again.actions(4) == found.actions(4)


@pytest.mark.parametrize("schedule", [S.ZeroBubbleH2(4), S.ZBV(4), S.VHalf(4), S.VMin(4)], ids=repr)
def test_new_schedules_merge_as_regions(schedule):
    text = S.ZeroBubbleH1(4)
    merged = S.RegionSchedule(
        (
            S.Region("vision", schedule, (0, 1), tuple(range(schedule.num_stages(2)))),
            S.Region("text", text, (2, 3), tuple(range(schedule.num_stages(2), schedule.num_stages(2) + 2))),
        ),
        edges=tuple((s, s + 1) for s in range(schedule.num_stages(2) + 1)),
    )
    S.validate(merged, 4)


def test_dualpipe_is_refused_as_a_region():
    with pytest.raises(ScheduleError, match="copies of the model's stages"):
        S.RegionSchedule((S.Region("main", S.DualPipe(4), (0, 1), (0, 1, 2, 3)),), edges=((0, 1), (2, 3)))


def test_new_schedules_draw_as_a_png_timeline(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for cls in S.MORE_SCHEDULES:
        t = cls(microbatches=8).timeline(4)
        fig, ax = plt.subplots()
        for rank, row in enumerate(t.events):
            ax.broken_barh([(e.start, e.end - e.start) for e in row], (rank - 0.4, 0.8))
        fig.savefig(tmp_path / f"{cls.__name__}.png")
        plt.close(fig)
        assert (tmp_path / f"{cls.__name__}.png").stat().st_size > 0
