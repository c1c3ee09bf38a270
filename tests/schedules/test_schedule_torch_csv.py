"""PyTorch's schedule CSV: `format_torch_csv`, `parse_torch_csv`, `read_torch_csv`.

Every shipped schedule round-trips in both forms (compute-only and with send/recv actions);
tables written by hand in PyTorch's format read as expected; bad fields, broken table rules and
communication that does not match the table are clear errors naming the rank, field and rule.
"""

import io
import re
from dataclasses import dataclass

import pytest

from spectrax_core import schedules as S
from spectrax_core.schedules import (
    Action,
    DeadlockError,
    FusedAction,
    ScheduleError,
    UserSchedule,
    format_torch_csv,
    parse_table,
    parse_torch_csv,
    read_torch_csv,
)


def shipped():
    """Every schedule of ALL_SCHEDULES and MORE_SCHEDULES at a few (n, m) where it is valid."""
    for cls in S.ALL_SCHEDULES + S.MORE_SCHEDULES:
        loop = cls.__dataclass_fields__["virtual_stages"].init
        for n, m in ((2, 4), (3, 7), (4, 8)):
            if cls is S.DualPipe and n % 2:
                continue  # DualPipe needs an even n
            yield pytest.param(cls(m), n, id=f"{cls.__name__}-n{n}-m{m}")
            if loop:
                yield pytest.param(cls(m + 1, virtual_stages=3), n, id=f"{cls.__name__}-v3-n{n}-m{m + 1}")


SHIPPED = list(shipped())


def test_every_shipped_schedule_is_covered():
    covered = {type(p.values[0]) for p in SHIPPED}
    assert covered == set(S.ALL_SCHEDULES + S.MORE_SCHEDULES)


@pytest.mark.parametrize("communication", [False, True], ids=["compute", "comms"])
@pytest.mark.parametrize("schedule, n", SHIPPED)
def test_every_shipped_schedule_round_trips(schedule, n, communication):
    table = schedule.actions(n)
    text = format_torch_csv(schedule, n, communication=communication)
    assert len(text.splitlines()) == n
    assert parse_torch_csv(text, schedule) == table
    if schedule.num_model_stages(n) == schedule.num_stages(n):  # DualPipe's copies need the schedule
        read = read_torch_csv(io.StringIO(text))
        assert read.actions(n) == table
        assert [read.stages_of(r, n) for r in range(n)] == [schedule.stages_of(r, n) for r in range(n)]


@pytest.mark.parametrize("schedule, n", SHIPPED)
def test_the_written_form_is_pytorchs(schedule, n):
    """Stages in model order on the ranks that hold them; fused cells as OVERLAP_F_B; each
    transfer's send on the producing rank and its receive on the reading one."""
    plain = format_torch_csv(schedule, n).splitlines()
    comms = format_torch_csv(schedule, n, communication=True).splitlines()
    for rank, row in enumerate(schedule.actions(n)):
        fields = plain[rank].split(",")
        assert len(fields) == len(row)
        for field, cell in zip(fields, row):
            if isinstance(cell, FusedAction):
                assert field == f"({cell.parts[0]!r};{cell.parts[1]!r})OVERLAP_F_B"
            else:
                assert field == repr(cell)
        stages = {int(s) for f in comms[rank].split(",") for s in re.findall(r"(?:^|[(;])(\d+)", f)}
        assert stages == set(schedule.stages_of(rank, n))
    sends = sum(f.count("SEND") for f in comms)
    assert sends == sum(f.count("RECV") for f in comms)


def test_the_forms_of_a_small_1f1b():
    s = S.Std1F1B(microbatches=2)
    assert format_torch_csv(s, 2) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert format_torch_csv(s, 2, communication=True) == (
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
        "1RECV_F0,1F0,1RECV_F1,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n"
    )


def test_stage_numbers_follow_the_layout():
    """A loop layout's rank r holds r, r + n, ...; a V's rank r holds r and 2n − 1 − r; the
    stages of a V that meet on the last rank exchange nothing (PyTorch's V special case)."""
    loop = format_torch_csv(S.InterleavedH1(4, virtual_stages=2), 2).splitlines()
    assert {f[0] for f in loop[0].split(",")} == {"0", "2"}
    assert {f[0] for f in loop[1].split(",")} == {"1", "3"}
    v = format_torch_csv(S.ZBV(4), 2, communication=True).splitlines()
    assert {f[0] for f in v[0].split(",")} == {"0", "3"} and {f[0] for f in v[1].split(",")} == {"1", "2"}
    assert not any(f.startswith(("1SEND_F", "2RECV_F", "2SEND_B", "1RECV_B")) for f in v[1].split(","))
    assert {f for f in v[1].split(",") if "SEND" in f} >= {"2SEND_F0", "1SEND_B0"}


# --- tables written by hand in PyTorch's format ------------------------------------------------------

SPLIT_1F1B = parse_table("""
    0F0 0F1 0I0 0W0 0I1 0W1
    1F0 1I0 1W0 1F1 1I1 1W1
""")
COMPUTE_ONLY = """\
0F0,0F1,,0I0,0W0,0I1,0W1,0REDUCE_GRAD
,1F0,1I0,1W0,1F1,1I1,1W1,1REDUCE_GRAD
"""
WITH_COMMS = (
    "0UNSHARD,0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0I0,0W0,0RECV_B1,0I1,0W1,0RESHARD\n"
    "1UNSHARD,1RECV_F0,1F0,1I0,1SEND_B0,1RECV_F1,1W0,1F1,1I1,1SEND_B1,1W1,1RESHARD\n"
)


def test_a_hand_written_compute_only_table():
    assert parse_torch_csv(COMPUTE_ONLY) == SPLIT_1F1B
    assert parse_torch_csv(COMPUTE_ONLY.replace("\n", "\r\n")) == SPLIT_1F1B
    assert parse_torch_csv(f"\n  \n{COMPUTE_ONLY}\n \n") == SPLIT_1F1B
    assert parse_torch_csv(COMPUTE_ONLY, S.ZeroBubbleH1(2)) == SPLIT_1F1B
    s = read_torch_csv(io.StringIO(COMPUTE_ONLY))
    assert s.actions(2) == SPLIT_1F1B and s.splits_backward and s.microbatches == 2


def test_a_hand_written_table_with_communication(tmp_path):
    assert parse_torch_csv(WITH_COMMS) == SPLIT_1F1B
    path = tmp_path / "schedule.csv"
    path.write_text(WITH_COMMS)
    assert read_torch_csv(path).actions(2) == SPLIT_1F1B
    assert read_torch_csv(str(path)).actions(2) == SPLIT_1F1B


def test_an_overlapped_cell_is_a_fused_action():
    text = "0F0,0F1,3F0,3I0,(3F1;0B0)OVERLAP_F_B,3I1,0B1,3W0,3W1\n1F0,2F0,1F1,2F1,2B0,1B0,2B1,1B1\n"
    table = parse_torch_csv(text)
    assert table[0][4] == FusedAction((Action("F", 3, 1), Action("B", 0, 0)))
    assert format_torch_csv(UserSchedule(table), 2) == text


# --- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, message",
    [
        ("0X0", r"rank 0 field 0 \('0X0'\): expected an action as PyTorch writes it"),
        ("F0", r"rank 0 field 0 \('F0'\): expected an action"),
        ("0F0,0B0\n1F0,1B0,1FB0", r"rank 1 field 2 \('1FB0'\): expected an action"),
        ("0F0,0B0,0F", r"rank 0 field 2 \('0F'\): F needs a microbatch \('0F0'\)"),
        ("0F0,0B0,0UNSHARD2", r"UNSHARD names a stage only \('0UNSHARD'\), no microbatch"),
        ("(0F0;1B0;1B1)OVERLAP_F_B", r"an overlapped cell holds a forward then a backward"),
        ("(1B0;0F0)OVERLAP_F_B", r"field 0 \('\(1B0;0F0\)OVERLAP_F_B'\): an overlapped cell"),
        ("(0F0;1W0)OVERLAP_F_B", r"an overlapped cell holds a forward then a backward"),
        ("\n \n", r"the text holds no table"),
    ],
)
def test_bad_fields_are_clear_errors(text, message):
    with pytest.raises(ScheduleError, match=message):
        parse_torch_csv(text)


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("0F0,,0B0,0B0\n1F0,1B0", ScheduleError, r"rank 0 cell 2 \(CSV field 3\) \(0B0\) appears twice"),
        ("0F0,0B0\n,1B0,1F0", ScheduleError, r"its F must come before its B/I .*\(CSV field 2\)"),
        ("0F0,0B0\n0F1,0B1", ScheduleError, r"stage 0 appears on ranks \[0, 1\]"),
        ("0F0,0I0\n1F0,1B0", ScheduleError, r"\(stage 0, microbatch 0\) has backward actions \['I'\]"),
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0", DeadlockError, r"rank 0 at cell 1 \(0B0\) waits for"),
        ("0F0,0B0,1UNSHARD\n1F0,1B0", ScheduleError, r"field 2 \(1UNSHARD\) names stage 1, which rank 0"),
    ],
)
def test_broken_table_rules_name_the_cell_and_its_field(text, error, message):
    with pytest.raises(error, match=message):
        parse_torch_csv(text)


def test_a_table_is_checked_against_the_schedule_given():
    with pytest.raises(ScheduleError, match=r"ZeroBubbleH1: rank 0 cell 1 \(0F1\) is out of range"):
        parse_torch_csv(COMPUTE_ONLY, S.ZeroBubbleH1(1))
    with pytest.raises(ScheduleError, match=r"stage 3 lives on rank 1, not on rank 0"):
        parse_torch_csv("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0", S.InterleavedGPipe(1, virtual_stages=2))


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (("1RECV_F1,", ""), ScheduleError, r"rank 1 lacks 1RECV_F1 \(stage 1 receives the forward output"),
        (("0F0,0SEND_F0", "0SEND_F0,0F0"), ScheduleError, r"field 1 \(0SEND_F0\) comes before the F of"),
        (("1RECV_F0,1F0", "1F0,1RECV_F0"), ScheduleError, r"field 2 \(1RECV_F0\) comes after the F of"),
        (("0W1,", "0W1,0SEND_F1,"), ScheduleError, r"field 11 \(0SEND_F1\) appears twice \(first at field 4"),
        (("1W1,", "1W1,1SEND_F1,"), ScheduleError, r"1SEND_F1\) is no transfer of the table: stage 1 sends"),
        (("0I0,", "0I0,0SEND_B0,"), ScheduleError, r"stage 0 sends its input gradient to no stage"),
        (("0SEND_F0,", "0SEND_F0,1RECV_F0,"), ScheduleError, r"\(1RECV_F0\) names stage 1, which rank 0"),
        (
            ("1RECV_F0,1F0,1I0,1SEND_B0,1RECV_F1", "1RECV_F1,1RECV_F0,1F0,1I0,1SEND_B0"),
            ScheduleError,
            r"rank 0 sends 0SEND_F0 \(field 2\) to rank 1 where the receive in the same place is 1RECV_F1",
        ),
        (
            ("0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0", "0F0,0RECV_B0,0SEND_F0,0F1,0SEND_F1"),
            DeadlockError,
            r"rank 0 waits at field 2 \(0RECV_B0\); rank 1 waits at field 1 \(1RECV_F0\)",
        ),
    ],
)
def test_communication_that_does_not_match_the_table_is_a_clear_error(edit, error, message):
    text = WITH_COMMS.replace(*edit)
    assert text != WITH_COMMS
    with pytest.raises(error, match=message):
        parse_torch_csv(text)


@dataclass(frozen=True)
class Joined(UserSchedule):
    """Stage 2 reads stages 0 and 1, which live on two other ranks."""

    def stage_inputs(self, n):
        return ((), (), (0, 1))

    def gradient_inputs(self, n):
        return ((2,), (2,), ())


def test_stages_that_do_not_form_chains_have_no_communication_form():
    joined = Joined(("0F0 0B0".split(), "1F0 1B0".split(), "2F0 2B0".split()))
    assert parse_torch_csv(format_torch_csv(joined, 3), joined) == joined.actions(3)
    with pytest.raises(ScheduleError, match=r"one neighbour per stage, so the stages must form chains"):
        format_torch_csv(joined, 3, communication=True)


def test_sources_of_the_wrong_type_are_type_errors():
    with pytest.raises(TypeError, match=r"parse_torch_csv: text must be a str, received bytes"):
        parse_torch_csv(COMPUTE_ONLY.encode())
    with pytest.raises(TypeError, match=r"read_torch_csv: source must be a path or a text file"):
        read_torch_csv(42)
    with pytest.raises(TypeError, match=r"format_torch_csv: schedule must be a Schedule, received tuple"):
        format_torch_csv(SPLIT_1F1B, 2)
