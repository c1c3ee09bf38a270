"""A plan's steps as one straight-line Python function, built once per plan.

A loop over the steps pays, per step, for indexing the buffer list for each
argument, a `zip` storing each result and a loop releasing each buffer: about a
quarter of a compiled call's own cost on the issuing thread for a cell of a few
buffers. The same steps written out as straight-line code keep every buffer in a
local variable (one slot, one name) and do none of that work at run time:

    b3, b4 = f0(b0, b1)
    b5, = f1(b3, b2)
    b0 = b3 = None

Each compiled program is called through JAX's C++ dispatch directly (`direct_call`).
With a run-ahead bound (`run_ahead`) the function also holds, at the steps where
a rank's cell starts and ends, the bound's wait and its count. It returns the
buffer list the loop would have left: each slot's last value, None where a slot
was released or never filled.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from .._compile.calls import direct_call
from .run_ahead import Gates, wait_for


def straight_line(
    steps: Sequence,
    n_slots: int,
    input_slots: Sequence[int],
    const_slots: dict,
    bound: tuple[int, Gates, list] | None = None,
) -> Callable[[Sequence], list]:
    """`run(placed) -> buffers` running `steps` (`(fn, ins, outs, frees)`) in order; `placed` are
    the values of `input_slots`, `const_slots` maps slots to constants. `bound`: `(limit, gates,
    most)` of a run-ahead bound (`most[r]` becomes the most cells rank `r` had outstanding)."""
    names: dict = {"_constants": tuple(const_slots.values()), "_deque": deque, "_wait": wait_for}
    body: list[str] = []
    filled = set(input_slots) | set(const_slots)
    if const_slots:
        body.append(f"{_targets(const_slots)} = _constants")
    if input_slots:  # after the constants: an input given for a constant's slot replaces it
        body.append(f"{_targets(input_slots)} = placed")
    unfilled = _read_before_filled(steps, filled)
    if unfilled:  # the loop passes None for these
        body.append(" = ".join(_slot(i) for i in unfilled) + " = None")
    if bound is not None:
        limit, gates, most = bound
        names.update(_limit=limit, _most=most)
        body.append(f"_most[:] = [0] * {gates.ranks:d}")
        body += [f"q{r:d} = _deque()" for r in range(gates.ranks)]
    for k, (fn, ins, outs, frees) in enumerate(steps):
        names[f"f{k:d}"] = direct_call(fn)
        call = f"f{k:d}({', '.join(_slot(i) for i in ins)})"
        starts = bound[1].starts[k] if bound is not None else -1
        ends = bound[1].ends[k] if bound is not None else -1
        if starts >= 0:
            body += [f"while len(q{starts:d}) >= _limit:", f"    _wait(q{starts:d}.popleft())"]
        if ends >= 0:
            body.append(f"r = {call}")
            body += [f"{_targets(outs)} = r"] if outs else []
            body += [f"q{ends:d}.append(r)", f"_most[{ends:d}] = max(_most[{ends:d}], len(q{ends:d}))"]
        else:
            body.append(f"{_targets(outs)} = {call}" if outs else call)
        if frees:
            body.append(" = ".join(_slot(f) for f in frees) + " = None")
    written = filled | {o for *_, outs, _ in steps for o in outs} | set(unfilled)
    body.append("return [" + ", ".join(_slot(s) if s in written else "None" for s in range(n_slots)) + "]")
    source = "def run(placed):\n" + "".join(f"    {line}\n" for line in body)
    exec(compile(source, "<spectrax_mpmd plan>", "exec"), names)
    return names["run"]


def _read_before_filled(steps: Sequence, filled: set) -> list[int]:
    """The slots a step reads before any input, constant or earlier step has filled them."""
    filled, early = set(filled), set()
    for _, ins, outs, frees in steps:
        early.update(i for i in ins if i not in filled)
        filled.update(outs)
        filled.update(frees)
    return sorted(early)


def _slot(slot: int) -> str:
    return f"b{slot:d}"  # an int, or a ValueError: nothing but numbers enters the source


def _targets(slots) -> str:
    """An assignment target unpacking a sequence into `slots` (`b3,` for one)."""
    return ", ".join(_slot(s) for s in slots) + ("," if len(slots) == 1 else "")
