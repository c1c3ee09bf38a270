"""`Advice.smallest_peak` under a budget nothing fits: the least budget any configuration the advisor
considers could run in, its per-stage offload and recompute choices and searched tables included;
that budget, given back, is accepted, and the messages name the same figure."""

import pytest
from planner_cases import MESH, TXS, init, lm_loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S

KWARGS = dict(
    mesh=MESH,
    schedules=(S.Std1F1B, S.ZeroBubbleH1),
    microbatches=(8,),
    virtual_stages=(1,),
    rounds=1,
    tx=TXS["adamw"],
)


def build(n_stages):
    return lm_loss(n_stages), init()


@pytest.fixture(scope="module")
def tight():
    """Advice under a budget no configuration meets, and the one without a budget."""
    return mp.advise(build, memory_budget=1000, **KWARGS), mp.advise(build, **KWARGS)


def peak(candidate) -> int:
    return max(candidate.peak_bytes)


def test_the_smallest_peak_counts_every_choice_considered(tight):
    advice, plain = tight
    assert not advice.fitting
    smallest = peak(advice.smallest_peak)
    assert smallest == min(peak(c) for c in advice.candidates)
    chosen = [c for c in advice.candidates if c.memory is not None]
    assert {c.name for c in chosen} == {"Std1F1B", "ZeroBubbleH1"}  # each with its least-peak choice
    assert "SearchedSchedule" in {c.name for c in advice.candidates}
    assert smallest < min(peak(c) for c in plain.candidates)  # below every plain configuration's
    assert advice.under(smallest).fitting and not advice.under(smallest - 1).fitting
    for message in (advice.table(), _error(advice)):
        assert f"{smallest / 2**20:.3f} MiB" in message or f"{smallest} bytes" in message
        assert "offload and recompute included" in message and "remat=True" not in message


def test_the_smallest_peak_as_the_budget_is_accepted(tight):
    smallest = peak(tight[0].smallest_peak)
    again = mp.advise(build, memory_budget=smallest, **KWARGS)
    assert again.best.fits and peak(again.best) <= smallest


def test_without_the_searched_tables_the_figure_is_exact():
    """Offload and recompute choices are predicted from bytes alone: the least budget they reach is
    accepted and one byte less is refused."""
    advice = mp.advise(build, memory_budget=1000, search=False, **KWARGS)
    smallest = peak(advice.smallest_peak)
    assert advice.smallest_peak.memory is not None
    assert mp.advise(build, memory_budget=smallest, search=False, **KWARGS).best.fits
    with pytest.raises(mp.MpmdError, match=rf"smallest peak of every configuration .* is {smallest} bytes"):
        mp.advise(build, memory_budget=smallest - 1, search=False, **KWARGS).best


def test_without_choices_the_message_says_how_to_get_them(tight):
    _, plain = tight
    message = _error(plain.under(1000))
    assert "let advise choose per-stage offload and recompute" in message


def _error(advice) -> str:
    with pytest.raises(mp.MpmdError) as err:
        advice.best
    return str(err.value)
