"""The nine schedules: every table validates, figures match closed forms, bad parameters fail.

Sweeps n in 1..8 and m in 1..4n (and v in 2..3 for the loop layouts).
"""

import pytest

from spectrax_core.schedules import (
    ALL_SCHEDULES,
    Action,
    DualPipeV,
    Eager1F1B,
    FusedAction,
    GPipe,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    ScheduleError,
    Std1F1B,
    ZeroBubbleH1,
    simulate,
)

NS = range(1, 9)
LOOP_1F1B = (InterleavedH1, Interleaved1F1BPlusOne, KimiK2)
LOOP = LOOP_1F1B + (InterleavedGPipe,)


def _variants():
    """(schedule, n) for every n in 1..8, m in 1..4n, v in {2, 3} where it applies."""
    for cls in ALL_SCHEDULES:
        for n in NS:
            for m in range(1, 4 * n + 1):
                for v in (2, 3) if cls in LOOP else (None,):
                    yield (cls(m) if v is None else cls(m, v)), n


def _smallest_valid_m(schedule, n):
    if isinstance(schedule, DualPipeV):
        return 2 * n
    if isinstance(schedule, LOOP_1F1B):
        return n
    return 1


@pytest.fixture(scope="module")
def sweep():
    """{(class, v, n, m): (total_steps, bubble_ratio, peak_activations)} over every valid variant.

    Invalid variants must raise naming the smallest valid m; a valid one's figures are
    read off its simulation at default costs (which validates the table).
    """
    figures = {}
    for s, n in _variants():
        m_min = _smallest_valid_m(s, n)
        if s.microbatches < m_min:
            with pytest.raises(ScheduleError, match=f"smallest valid microbatches is {m_min}"):
                s.actions(n)
            continue
        t = s.timeline(n)
        assert (s.total_steps(n), s.bubble_ratio(n), s.peak_activations(n)) == (
            t.makespan,
            t.bubble_fraction,
            max(t.peak_activations),
        )
        figures[type(s), s.virtual_stages, n, s.microbatches] = (
            t.makespan,
            t.bubble_fraction,
            max(t.peak_activations),
        )
    return figures


def test_every_valid_table_simulates(sweep):
    assert len(sweep) > 1500


def _closed_form(s, n):
    """(total_steps, peak_activations) at T_F = T_I = T_W = 1, T_B = 2, or None if unknown."""
    m, v = s.microbatches, s.virtual_stages
    if isinstance(s, GPipe):
        return 3 * (m + n - 1), m
    if isinstance(s, Std1F1B):
        return 3 * (m + n - 1), min(m, n)
    if isinstance(s, Eager1F1B):
        return 3 * (m + n - 1), min(m, 2 * n - 1)
    if isinstance(s, ZeroBubbleH1):
        return 3 * m + n - 1 + max(0, n - m), min(m, n)
    if isinstance(s, DualPipeV):
        return 6 * m + 2 * (n - 1), 2 * n + 1
    if m < n:
        return None
    if isinstance(s, InterleavedGPipe):
        return 3 * (v * m + n - 1), m * v
    first_round = n + m % n
    extra = 0 if isinstance(s, InterleavedH1) else 1
    return 3 * (v * m + n - 1), min(m * v, 2 * (n - 1) + (v - 1) * first_round + 1 + extra)


def test_figures_equal_their_closed_forms(sweep):
    compared = 0
    for (cls, v, n, m), (steps, bubble, peak) in sweep.items():
        s = cls(m, v) if cls in LOOP else cls(m)
        expected = _closed_form(s, n)
        if expected is None:
            continue
        assert (steps, peak) == expected, (s, n)
        work = 3 * m * v
        assert bubble == pytest.approx((steps - work) / steps), (s, n)
        compared += 1
    assert compared > 1500


@pytest.mark.parametrize("cls", ALL_SCHEDULES)
def test_one_rank(cls):
    s = cls(2)
    s.validate(1)
    assert s.bubble_ratio(1) == 0


@pytest.mark.parametrize("cls", [GPipe, Std1F1B, Eager1F1B, ZeroBubbleH1, InterleavedGPipe])
@pytest.mark.parametrize("m", [1, 2, 3])
def test_fewer_microbatches_than_ranks_degrade_gracefully(cls, m):
    s = cls(m)
    s.validate(5)
    assert s.peak_activations(5) == m * s.virtual_stages


def test_interleaved_beats_its_flat_counterpart(sweep):
    for n in range(2, 9):
        for m in range(n, 4 * n + 1):
            for v in (2, 3):
                for cls in LOOP_1F1B:
                    assert sweep[cls, v, n, m][1] < sweep[Std1F1B, 1, n, m][1], (cls, v, n, m)
                assert sweep[InterleavedGPipe, v, n, m][1] < sweep[GPipe, 1, n, m][1], (v, n, m)


def test_zb_h1_spreads_w_through_the_steady_state():
    n, m = 4, 16
    table = ZeroBubbleH1(m).actions(n)
    for rank, row in enumerate(table):
        kinds = [a.kind for a in row]
        last_f = max(i for i, k in enumerate(kinds) if k == "F")
        assert kinds.index("W") < last_f  # not piled at the end
        trailing_w = len(kinds) - len("".join(kinds).rstrip("W"))
        assert trailing_w == rank + 1  # the rank's r held-back Ws plus the last one
    assert ZeroBubbleH1(m).peak_activations(n) == n
    assert ZeroBubbleH1(m).bubble_ratio(n) < Std1F1B(m).bubble_ratio(n) / 2


def test_kimi_k2_is_plus_one_with_steady_pairs_fused_and_independent():
    for n in range(1, 9):
        for m in range(n, 3 * n + 1):
            for v in (2, 3):
                kimi = KimiK2(m, v).actions(n)
                plus = Interleaved1F1BPlusOne(m, v).actions(n)
                flat = [[a for c in row for a in c.parts] for row in kimi]
                assert flat == [list(r) for r in plus]
                for row in kimi:
                    for cell in row:
                        if isinstance(cell, FusedAction):
                            f, b = cell.parts
                            assert f.microbatch != b.microbatch, (n, m, v, cell)


def test_plain_interleaved_pairs_a_forward_with_its_own_backward():
    # what the "+1" removes: on the last rank the first steady F and B share a microbatch
    row = InterleavedH1(8, 2).actions(4)[3]
    first_b = next(i for i, a in enumerate(row) if a.kind == "B")
    assert row[first_b - 1] == Action("F", 7, 0) and row[first_b] == Action("B", 7, 0)


def test_dualpipe_v_shape_cells_and_split_tail():
    n, m = 4, 10
    s = DualPipeV(m)
    assert [s.stages_of(r, n) for r in range(n)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    table = s.actions(n)
    for row in table:
        kinds = [c.kind for c in row]
        assert "F&B" in kinds and "I" in kinds and "W" in kinds
        # fused cells pair the two chunks of the rank
        for c in row:
            if isinstance(c, FusedAction):
                assert c.parts[0].stage != c.parts[1].stage
    assert s.peak_activations(n) == 2 * n + 1
    assert simulate(s, n).peak_activations[0] == 2 * n + 1


@pytest.mark.parametrize(
    "cls, layout",
    [
        (GPipe, [(0,), (1,), (2,)]),
        (ZeroBubbleH1, [(0,), (1,), (2,)]),
        (InterleavedH1, [(0, 3), (1, 4), (2, 5)]),
        (InterleavedGPipe, [(0, 3), (1, 4), (2, 5)]),
        (DualPipeV, [(0, 5), (1, 4), (2, 3)]),
    ],
)
def test_layouts(cls, layout):
    s = cls(6)
    assert [s.stages_of(r, 3) for r in range(3)] == layout
    for r, stages in enumerate(layout):
        for c, stage in enumerate(stages):
            assert s.stage_of(r, c, 3) == stage and s.rank_of(stage, 3) == r
    with pytest.raises(ScheduleError, match="rank must be in 0..2"):
        s.stage_of(3, 0, 3)
    with pytest.raises(ScheduleError, match="local chunk v must be"):
        s.stage_of(0, len(stages), 3)
    with pytest.raises(ScheduleError, match="stage must be in"):
        s.rank_of(3 * len(stages), 3)


def test_common_interface():
    for cls in ALL_SCHEDULES:
        s = cls(8)
        assert s.actions(4) is s.actions(4)  # memoised
        assert hash(s) == hash(cls(8)) and s == cls(8)
        assert s.virtual_stages == (2 if cls in LOOP or cls is DualPipeV else 1)
        kinds = {a.kind for row in s.actions(4) for c in row for a in c.parts}
        assert s.splits_backward == bool(kinds & {"I", "W"}), cls
        with pytest.raises(AttributeError):
            s.microbatches = 3
    assert GPipe(8) != Std1F1B(8)
    with pytest.raises(TypeError):
        DualPipeV(8, virtual_stages=3)
    with pytest.raises(TypeError):
        GPipe(8, virtual_stages=2)


@pytest.mark.parametrize("cls", ALL_SCHEDULES)
def test_bad_parameters(cls):
    with pytest.raises(ValueError, match="microbatches must be >= 1, received 0"):
        cls(0)
    with pytest.raises(TypeError, match="microbatches must be an int"):
        cls(2.0)
    s = cls(8)
    with pytest.raises(ValueError, match=r"n \(number of ranks\) must be >= 1"):
        s.actions(0)
    with pytest.raises(TypeError, match=r"n \(number of ranks\) must be an int"):
        s.actions(4.0)


@pytest.mark.parametrize("cls", LOOP)
def test_loop_schedules_need_two_virtual_stages(cls):
    with pytest.raises(ValueError, match="virtual_stages must be >= 2, received 1"):
        cls(8, 1)


def test_dualpipe_v_names_its_rule():
    rule = r"microbatches >= 2 \* n .* smallest valid microbatches is 8"
    with pytest.raises(ValueError, match=rule):
        DualPipeV(7).actions(4)


def test_interleaved_names_its_rule():
    with pytest.raises(ValueError, match="rounds of n = 4 .* smallest valid microbatches is 4"):
        InterleavedH1(3).actions(4)
