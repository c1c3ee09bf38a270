"""Transfers issued together (`spectrax_mpmd._plan.moves`): on random step lists of real moves
between devices the batched steps leave the buffers the plan's order leaves, no transfer waits
past more compiled calls than allowed, moves between memory kinds keep their place, and every
schedule's plan issues fewer transfer calls than it has transfers (its values are checked against
the unsplit step by the exactness tests, on the same cached cases)."""

import random

import jax
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding
from mpmd_cases import ALL, config_of

from spectrax_mpmd._comm import is_transfer, transfer
from spectrax_mpmd._plan.moves import batched_moves
from spectrax_mpmd._runtime.plan import Step

DEVICES = 4


def _on(device: int) -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[device])


def compute(k: int, devices: list):
    """A step making one value per output slot, on that slot's device, from what it read
    (a slot not filled yet reads as 0)."""

    def fn(*args):
        total = sum(float(np.asarray(a).sum()) for a in args if a is not None)
        values = [np.full(2, 10.0 * k + j + total, np.float32) for j in range(len(devices))]
        return [jax.device_put(v, _on(d)) for v, d in zip(values, devices)]

    return fn


def random_steps(rng: random.Random, n_slots: int) -> tuple[list, dict]:
    """Compute steps and moves over slots each fixed to a device; a move reads a filled slot."""
    device_of = {s: rng.randrange(DEVICES) for s in range(n_slots)}
    steps, filled = [], set()
    for k in range(rng.randint(4, 24)):
        if filled and rng.random() < 0.5:
            sources = rng.sample(sorted(filled), rng.randint(1, min(2, len(filled))))
            targets = rng.sample([s for s in range(n_slots) if s not in sources], len(sources))
            fn = transfer([_on(device_of[s]) for s in sources], [_on(device_of[t]) for t in targets])
            steps.append(Step(fn, tuple(sources), tuple(targets)))
            filled.update(targets)
        else:
            ins = tuple(rng.sample(range(n_slots), rng.randint(0, 3)))
            outs = tuple(rng.sample(range(n_slots), rng.randint(0, 2)))
            frees = tuple(rng.sample(range(n_slots), rng.randint(0, 1)))
            steps.append(Step(compute(k, [device_of[o] for o in outs]), ins, outs, frees))
            filled = (filled | set(outs)) - set(frees)
    return steps, device_of


def run(steps: list, n_slots: int) -> list:
    buf = [None] * n_slots
    for fn, ins, outs, frees in steps:
        for o, value in zip(outs, fn(*[buf[i] for i in ins])):
            buf[o] = value
        for f in frees:
            buf[f] = None
    return buf


def _described(buf: list) -> list:
    return [None if x is None else (np.asarray(x).tolist(), x.sharding) for x in buf]


@pytest.mark.parametrize("seed", range(30))
def test_batched_moves_leave_the_buffers_the_plan_order_leaves(seed):
    rng = random.Random(seed)
    n_slots = rng.randint(4, 10)
    steps, _ = random_steps(rng, n_slots)
    batched, issued_of = batched_moves(steps, (), within=rng.randint(1, 4))
    assert _described(run(batched, n_slots)) == _described(run(steps, n_slots))
    assert len(issued_of) == len(steps)
    for k, step in enumerate(steps):  # every step is run by the batched step it maps to
        assert set(step.outs) <= set(batched[issued_of[k]].outs)


def test_random_lists_do_batch():
    """The random lists above are not all left alone: some moves meet."""
    merged = 0
    for seed in range(30):
        rng = random.Random(seed)
        steps, _ = random_steps(rng, rng.randint(4, 10))
        merged += len(steps) - len(batched_moves(steps, (), within=rng.randint(1, 4))[0])
    assert merged > 10


def test_a_move_waits_past_at_most_within_compiled_calls():
    """Three moves from device 0, then six compute steps that touch none of them: with `within=2`
    the moves go out together after the second compute step."""
    moves = [Step(transfer([_on(0)], [_on(1)]), (s,), (10 + s,)) for s in range(3)]
    calls = [Step(compute(k, [2]), (), (20 + k,)) for k in range(6)]
    batched, issued_of = batched_moves([*moves, *calls], (), within=2)
    kinds = ["move" if is_transfer(step.fn) else "call" for step in batched]
    assert kinds == ["call", "call", "move", "call", "call", "call", "call"]
    assert issued_of[:3] == (2, 2, 2)
    assert batched[2].ins == (0, 1, 2) and batched[2].outs == (10, 11, 12)


def test_a_reader_gets_its_move_first_and_chained_moves_stay_apart():
    """A move read by the next step goes out before it; a move reading another waiting move's
    result is not batched with it."""
    first = Step(transfer([_on(0)], [_on(1)]), (0,), (1,))
    chained = Step(transfer([_on(1)], [_on(2)]), (1,), (2,))
    reader = Step(compute(0, [2]), (2,), (3,))
    batched, issued_of = batched_moves([first, chained, reader], (), within=8)
    assert [step.outs for step in batched] == [(1,), (2,), (3,)]
    assert issued_of == (0, 1, 2)


def test_moves_between_memory_kinds_keep_their_place():
    """An offload to host memory runs where the plan put it (its point is to free device memory
    then); device moves around it still batch."""
    device = jax.devices()[0]
    host = SingleDeviceSharding(device, memory_kind="pinned_host")
    offload = Step(transfer([_on(0)], [host]), (0,), (5,))
    moves = [Step(transfer([_on(0)], [_on(1)]), (s,), (10 + s,)) for s in (1, 2)]
    call = Step(compute(0, [3]), (), (20,))
    reader = Step(compute(1, [1]), (11,), (21,))
    batched, _ = batched_moves([moves[0], offload, moves[1], call, reader], (), 8)
    assert [step.outs for step in batched] == [(5,), (20,), (11, 12), (21,)]


@pytest.mark.parametrize("name", ALL)
def test_every_schedule_issues_fewer_transfer_calls_than_transfers(run_case, name):
    case = run_case(name, *config_of(name), False)
    plan = case.step.plan_for(case.params, case.batch)
    moves = sum(is_transfer(step.fn) for step in plan.steps)
    issued = sum(is_transfer(step.fn) for step in plan.hot_steps)
    assert 0 < issued < moves
    moved = {slot for step in plan.steps if is_transfer(step.fn) for slot in step.outs}
    assert moved == {slot for step in plan.hot_steps if is_transfer(step.fn) for slot in step.outs}
