"""A plan's steps written out as straight-line code leave the buffers a step-by-step loop over a
buffer list leaves: on random step lists (no, one or several results, releases, constants, an
input given for a constant's slot, a slot read before any step fills it), and with a run-ahead
bound on jax arrays (its waits and counts)."""

import random

import jax.numpy as jnp
import pytest

from spectrax_mpmd._runtime import straight
from spectrax_mpmd._runtime.run_ahead import Gates


def looped(steps, n_slots, input_slots, const_slots, placed) -> list:
    """The loop the straight-line function replaces (one list of buffers, indexed per step)."""
    buf = [None] * n_slots
    for slot, value in const_slots.items():
        buf[slot] = value
    for slot, value in zip(input_slots, placed):
        buf[slot] = value
    for fn, ins, outs, frees in steps:
        results = fn(*[buf[i] for i in ins])
        for o, r in zip(outs, results):
            buf[o] = r
        for f in frees:
            buf[f] = None
    return buf


def step_fn(k: int, n_out: int):
    """A step returning `n_out` values that record the step and what it read."""
    return lambda *args: [(k, j, args) for j in range(n_out)]


def random_steps(rng: random.Random, n_slots: int) -> tuple:
    input_slots = rng.sample(range(n_slots), 3)
    const_slots = {s: f"const{s}" for s in rng.sample(range(n_slots), 3)}  # may share an input's slot
    steps = []
    for k in range(rng.randint(1, 12)):
        ins = tuple(rng.sample(range(n_slots), rng.randint(0, 4)))
        outs = tuple(rng.sample(range(n_slots), rng.choice([0, 1, 1, 2, 3])))
        frees = tuple(rng.sample(range(n_slots), rng.randint(0, 3)))
        steps.append((step_fn(k, len(outs)), ins, outs, frees))
    return steps, input_slots, const_slots


@pytest.mark.parametrize("seed", range(40))
def test_straight_line_leaves_what_the_loop_leaves(seed):
    rng = random.Random(seed)
    n_slots = rng.randint(6, 14)
    steps, input_slots, const_slots = random_steps(rng, n_slots)
    placed = [f"input{s}" for s in input_slots]
    want = looped(steps, n_slots, input_slots, const_slots, placed)
    assert straight.straight_line(steps, n_slots, input_slots, const_slots)(placed) == want


def test_a_bound_waits_for_the_oldest_cell_and_counts_the_most_outstanding(monkeypatch):
    """Two ranks' cells, each one step; with a limit of 2 each rank's third cell is issued only after
    a wait on its first cell's outputs (the waits are recorded as they happen), the values are the
    unbounded ones, and `most` says how many each rank had at once."""
    waited = []
    monkeypatch.setattr(straight, "wait_for", lambda outputs: waited.append(outputs[0].tolist()))
    double = lambda x: [x * 2]  # noqa: E731
    steps = [(double, (k % 2,), (k % 2,), ()) for k in range(6)]  # ranks 0, 1, 0, 1, ...
    gates = Gates(starts=(0, 1) * 3, ends=(0, 1) * 3, ranks=2)
    placed = [jnp.ones(3), jnp.ones(3) * 3]
    most: list = []
    got = straight.straight_line(steps, 2, (0, 1), {}, (2, gates, most))(placed)
    want = looped(steps, 2, (0, 1), {}, placed)
    assert [g.tolist() for g in got] == [w.tolist() for w in want] == [[8.0] * 3, [24.0] * 3]
    assert waited == [[2.0] * 3, [6.0] * 3]  # before steps 4 and 5: each rank's first cell (steps 0, 1)
    assert most == [2, 2]
