"""The advice's last word: when the fastest fitting candidates are predicted closer together than
the time model's error, each is built and run, and the fastest measured is chosen.

A prediction is held to `MODEL_ERROR` of a measured step's time relative to
plain Std1F1B (`tests/mpmd/test_mpmd_planner_costs.py`), so two candidates
predicted within that of each other cannot be told apart by the model. When a
budget rules plain Std1F1B out (when it fits, the fastest predicted is never
predicted slower than it, and is the pick), up to `confirm` of them (the
fastest predicted first) are built with `Advice.step` and run in interleaved
rounds (each round runs every one once, so the load of other work meets them
alike), the order turned by one place each round (on shared cores a step's place
in the round matters: measured in a fixed order, steps predicted within 3% of
each other came out up to 1.33x apart, turned each round within 8%), and the
medians decide. `Advice.confidence` says which way the choice
was made.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import jax
import optax

from .advice import MODEL_ERROR, Advice, Candidate, predicted_confidence


def contenders(advice: Advice, confirm: int) -> list[Candidate]:
    """The fitting candidates worth measuring: none when plain Std1F1B fits (the pick, the
    fastest predicted, is then never predicted slower than it) or no budget was given;
    otherwise, among the `confirm` fastest predicted, those within `MODEL_ERROR` of the
    fastest."""
    default = advice.default
    if advice.memory_budget is None or (default is not None and default.fits):
        return []
    top = list(advice.fitting[:confirm])
    return [c for c in top if c.step_s <= top[0].step_s * (1 + MODEL_ERROR)]


def measure_steps(advice: Advice, candidates: list[Candidate], rounds: int) -> list[float]:
    """Median wall seconds of each candidate's whole training step (`Advice.step`, not donating),
    over `rounds` rotated rounds (`rotated_medians`) after one warm-up call each."""
    tx = advice.source.tx if advice.source.tx is not None else optax.adam(1e-3)
    runs = []
    for c in candidates:
        step = advice.step(tx, candidate=c, donate=False)
        params, *batch = advice.arguments(c)
        state = tx.init(params)
        jax.block_until_ready(step(params, state, *batch))
        runs.append(functools.partial(step, params, state, *batch))
    return rotated_medians(runs, rounds)


def rotated_medians(calls: list[Callable], rounds: int) -> list[float]:
    """Median wall seconds of each of `calls` (each waited for), over `rounds` rounds that run
    every call once, round k starting at call k (mod their count): each call takes each place
    in the round alike."""
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for k in (*range(r % len(calls), len(calls)), *range(r % len(calls))):
            start = time.perf_counter()
            jax.block_until_ready(calls[k]())
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def confirmed(advice: Advice, confirm: int, rounds: int) -> Advice:
    """`advice` with its pick made as the module docstring says, and `confidence` set."""
    close = contenders(advice, confirm) if confirm > 1 and advice.fitting else []
    if len(close) < 2:
        return replace(advice, confidence=predicted_confidence(advice))
    seconds = measure_steps(advice, close, max(rounds, 3))
    measured = tuple(sorted(zip(close, seconds), key=lambda pair: pair[1]))
    pick = measured[0][0]
    rest = tuple(c for c in advice.candidates if c is not pick)
    runner = measured[1]
    note = (
        f"measured: {len(close)} candidates predicted within the model's {MODEL_ERROR:.0%} ratio error of "
        f"each other were run; the pick was {runner[1] / measured[0][1] - 1:.0%} faster than the next"
    )
    return replace(advice, candidates=(pick, *rest), measured=measured, confidence=note)
