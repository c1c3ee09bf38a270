"""Every schedule, on a heterogeneous pipeline: exact loss and gradients, and the issue order.

The reference is `jax.value_and_grad` of the unsplit function on one device;
the pipelined loss is the mean of the microbatch losses, which equals the
full-batch mean up to fp32 summation order (rtol 1e-5 / atol 1e-6).
"""

import pytest
from mpmd_cases import ALL, VIRTUAL, assert_close, config_of


def _id(name: str, n: int, v: int, remat: bool) -> str:
    return f"{name}-n{n}v{v}-{'remat' if remat else 'saved'}"


CASES = [
    pytest.param(name, *config_of(name), remat, id=_id(name, *config_of(name), remat))
    for name in ALL
    for remat in (False, True)
]
WIDE = [
    pytest.param(name, 4, 2, remat, id=_id(name, 4, 2, remat), marks=pytest.mark.slow)
    for name in VIRTUAL
    for remat in (False, True)
]


@pytest.mark.parametrize("name,n,v,remat", CASES + WIDE)
def test_loss_and_every_gradient_match_the_unsplit_function(run_case, name, n, v, remat):
    case = run_case(name, n, v, remat)
    assert case.loss.shape == ()
    assert_close(case.loss, case.ref_loss)
    assert_close(case.grads, case.ref_grads)


@pytest.mark.parametrize("name,n,v,remat", CASES + WIDE)
def test_dispatch_log_per_rank_is_the_schedule_table(run_case, name, n, v, remat):
    case = run_case(name, n, v, remat)
    table = case.schedule.actions(n)
    per_rank = [tuple(a for r, a, _ in case.log if r == rank) for rank in range(n)]
    assert per_rank == [tuple(row) for row in table]
    assert {r for r, _, _ in case.log} == set(range(n))


def _expected_cell(action, last: int) -> str:
    names = []
    for p in action.parts:
        if p.stage == last:
            names.append("FB" if p.kind == "F" else "-")
        else:
            names.append(p.kind)
    return "&".join(x for x in names if x != "-") or "-"


@pytest.mark.parametrize("name,n,v,remat", CASES)
def test_cell_names_in_the_log(run_case, name, n, v, remat):
    """Non-last stages run their own F/B/I/W cell; the last stage's F is the fused loss cell "FB"."""
    case = run_case(name, n, v, remat)
    last = n * case.schedule.virtual_stages - 1
    for rank, action, cell in case.log:
        assert cell == _expected_cell(action, last), (rank, action, cell)
        assert all(case.schedule.rank_of(p.stage, n) == rank for p in action.parts)


@pytest.mark.parametrize("name,n,v,remat", CASES)
def test_issue_order_respects_data_dependencies(run_case, name, n, v, remat):
    """Across ranks, each action is issued after everything it reads (the stages form a chain)."""
    case = run_case(name, n, v, remat)
    last = n * case.schedule.virtual_stages - 1
    done: set = set()
    for _, action, _ in case.log:
        for p in action.parts:
            s, i = p.stage, p.microbatch
            if p.kind == "F" and s > 0:
                assert ("F", s - 1, i) in done, (action, "forward before its input")
            if p.kind in ("B", "I"):
                assert ("F", s, i) in done, (action, "backward before its forward")
                if s < last:
                    assert ("B", s + 1, i) in done or ("I", s + 1, i) in done, (action, "no cotangent yet")
            if p.kind == "W":
                assert ("I", s, i) in done, (action, "W before I")
        for p in action.parts:
            done.add((p.kind, p.stage, p.microbatch))
    assert len(done) == sum(len(a.parts) for _, a, _ in case.log)
