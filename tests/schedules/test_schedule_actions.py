"""`Action` and `FusedAction`: fields, strings, hashing, rejected inputs."""

import pytest

from spectrax_core.schedules import Action, FusedAction, ScheduleError


def test_action_strings_hash_and_slots():
    a = Action("F", 2, 3)
    assert str(a) == "F3" and repr(a) == "2F3"
    assert a == Action("F", 2, 3) and hash(a) == hash(Action("F", 2, 3))
    assert not hasattr(a, "__dict__")
    with pytest.raises(AttributeError):
        a.kind = "B"
    assert a.parts == (a,)


@pytest.mark.parametrize("args", [("X", 0, 0), ("F", -1, 0), ("F", 0, 1.5), ("F&B", 0, 0)])
def test_action_rejects_bad_fields(args):
    with pytest.raises(ValueError, match="Action"):
        Action(*args)


def test_fused_action():
    f = FusedAction((Action("F", 1, 3), Action("B", 1, 1)))
    assert f.kind == "F&B" and str(f) == "F3&B1" and repr(f) == "1F3&1B1"
    assert FusedAction([Action("F", 1, 3), Action("I", 1, 1)]).parts[1].kind == "I"
    assert hash(f) == hash(FusedAction((Action("F", 1, 3), Action("B", 1, 1))))


@pytest.mark.parametrize(
    "parts",
    [
        (Action("B", 0, 0), Action("F", 0, 1)),
        (Action("F", 0, 0), Action("W", 0, 1)),
        (Action("F", 0, 0),),
        (Action("F", 0, 0), Action("B", 0, 1), Action("B", 0, 2)),
    ],
)
def test_fused_action_rejects_bad_parts(parts):
    with pytest.raises(ValueError, match="FusedAction"):
        FusedAction(parts)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)
