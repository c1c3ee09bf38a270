"""PyTorch's schedule CSV: `format_torch_csv` writes a table in it, `parse_torch_csv` reads one.

`torch.distributed.pipelining` keeps a schedule as one CSV row per pipeline rank, one action
per field in the order the rank runs them, an empty field an idle step. An action is its
stage, its type and its microbatch: `2F0` (forward), `1I3` (input gradient), `2W1` (weight
gradient), `3B0` (whole backward) are the cells of our tables with the same text, and
`(0F3;7B1)OVERLAP_F_B` is a forward and a backward run as one cell, our `FusedAction`
`0F3&7B1`. Stage numbers on both sides are the logical stages in model order (a loop layout's
rank r holds r, r + n, ...; a V's rank r holds r and 2n − 1 − r), so a cell maps to itself.

The form with communication adds, on the rank of the stage named: `pSEND_Fk` after the forward
of stage p on microbatch k (its output goes to the stage that reads it), `cRECV_Fk` before the
forward of stage c that reads it, `cSEND_Bk` after the B or I of stage c (its input gradient
goes back), `pRECV_Bk` before the B or I of stage p that waits for it. Only stages on different
ranks exchange anything. FSDP's `UNSHARD` / `RESHARD` and the gradient reduction `REDUCE_GRAD`
(`0UNSHARD`, no microbatch) are read and left out: the MPMD runtime does neither.
"""

from __future__ import annotations

import csv
import io
import os
import re
from typing import NamedTuple

from ._actions import Action, Cell, FusedAction, ScheduleError, Table, check_table
from ._base import Schedule
from ._flow import DeadlockError, Flow, issue_order
from ._simulate import walk_table
from ._user import UserSchedule

_COMPUTE = ("F", "B", "I", "W")
_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_IGNORED = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
_TEXT = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD|F|B|I|W)(\d*)")
_OVERLAP = re.compile(r"\(([^()]*)\)OVERLAP_F_B")
_EXPECTED = (
    "expected an action as PyTorch writes it: stage, type, microbatch ('2F0'; types F, B, I, W, "
    "SEND_F, RECV_F, SEND_B, RECV_B), an overlapped pair '(0F3;7B1)OVERLAP_F_B', a stage's "
    "'0UNSHARD', '0RESHARD' or '0REDUCE_GRAD', or an empty field (idle)"
)


class _Comm(NamedTuple):
    """A communication action: `kind` one of `_COMMS`, on `stage` and `microbatch`."""

    kind: str
    stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


class _Other(NamedTuple):
    """An UNSHARD / RESHARD / REDUCE_GRAD of `stage`: read, checked, left out."""

    kind: str
    stage: int

    def __repr__(self) -> str:
        return f"{self.stage}{self.kind}"


class _Field(NamedTuple):
    """A non-empty field of a row: where it is and what it holds."""

    rank: int
    index: int
    item: object  # Cell, _Comm or _Other


def format_torch_csv(schedule, n: int, *, communication: bool = False) -> str:
    """`schedule`'s table on `n` ranks as PyTorch's CSV: one row per rank, one field per cell.

    With `communication=True`, the form with send and receive actions: each send right after
    the cell that produces what it sends, and its receive on the reading rank at the same point
    of the one order that issues the table (`issue_order`), so every receive comes before the
    cell that reads it, the sends and receives between two ranks pair up in order, and the
    rows run without deadlock under PyTorch's rules. The stages must form chains (each stage
    reads at most one stage on another rank, and at most one stage there reads it), as
    PyTorch's actions name one neighbour per stage. Idle steps are not written.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(
            f"format_torch_csv: schedule must be a Schedule, received {type(schedule).__name__}; "
            "wrap a table as UserSchedule(table)."
        )
    table = schedule.actions(n)
    schedule.validate(n)
    if not communication:
        rows = [[_token(cell) for cell in row] for row in table]
    else:
        forward, backward = _links(schedule, n)
        rows = [[] for _ in range(n)]
        for rank, cell in issue_order(table, schedule.flow(n)):
            rows[rank].append(_token(cell))
            for a in cell.parts:
                links, kind = (forward, "F") if a.kind == "F" else (backward, "B")
                peer = links.get(a.stage) if a.kind != "W" else None
                if peer is not None:
                    rows[rank].append(f"{a.stage}SEND_{kind}{a.microbatch}")
                    rows[schedule.rank_of(peer, n)].append(f"{peer}RECV_{kind}{a.microbatch}")
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def parse_torch_csv(text: str, schedule=None) -> Table:
    """The table in PyTorch's CSV `text` (either form; see the module docstring): row r is rank
    r's cells in order; empty fields (idle), `UNSHARD`, `RESHARD` and `REDUCE_GRAD` are left out.

    The cells are checked as our own tables are: with `schedule`, as `parse_table` checks
    them (`check_table`'s rules on as many ranks as there are rows, and no deadlock); without,
    as a `UserSchedule` (the table then fixes where each stage lives). Send and receive actions
    are checked against the cells and then dropped (the runtime derives its transfers): each
    transfer between stages on different ranks appears once per microbatch, its send after the
    cell that produces what it sends and its receive before the cell that reads it; the sends
    and receives between two ranks come in the same order; and the rows run without deadlock
    when a receive waits for its send.
    Errors (`ScheduleError`, `DeadlockError`) name the rank, the field and the rule.
    """
    if not isinstance(text, str):
        raise TypeError(f"parse_torch_csv: text must be a str, received {type(text).__name__}.")
    fields = _read(text)
    table = tuple(tuple(f.item for f in row if isinstance(f.item, (Action, FusedAction))) for row in fields)
    n = len(table)
    try:
        if schedule is None:
            schedule = UserSchedule(table)
        else:
            check_table(schedule, n, table)
            walk_table(schedule, n, table, schedule.flow(n))
    except ScheduleError as err:
        raise _in_fields(err, fields) from None
    _check_others(schedule, n, fields)
    if any(isinstance(f.item, _Comm) for row in fields for f in row):
        _check_comms(schedule, n, fields)
    return table


def _token(cell: Cell) -> str:
    if isinstance(cell, FusedAction):
        return f"({cell.parts[0]!r};{cell.parts[1]!r})OVERLAP_F_B"
    return repr(cell)


def _read(text: str) -> list[list[_Field]]:
    lines = text.splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    while lines and not lines[0].strip():
        lines.pop(0)
    rows = []
    for rank, raw in enumerate(csv.reader(lines)):
        row = []
        for index, value in enumerate(raw):
            if value.strip():
                row.append(_Field(rank, index, _item(value.strip(), rank, index)))
        rows.append(row)
    if not rows:
        raise ScheduleError(
            "parse_torch_csv: the text holds no table; write one CSV row of actions per rank."
        )
    return rows


def _item(value: str, rank: int, index: int):
    where = f"parse_torch_csv: rank {rank} field {index} ({value!r})"
    overlap = _OVERLAP.fullmatch(value)
    if overlap:
        parts = [_item(p.strip(), rank, index) for p in overlap[1].split(";") if p.strip()]
        ok = len(parts) == 2 and all(isinstance(p, Action) for p in parts)
        if not ok or parts[0].kind != "F" or parts[1].kind not in ("B", "I"):
            raise ScheduleError(
                f"{where}: an overlapped cell holds a forward then a backward, '(0F3;7B1)OVERLAP_F_B' "
                "(the backward B or I), the one kind of fused cell the runtime runs."
            )
        return FusedAction(tuple(parts))
    match = _TEXT.fullmatch(value)
    if match is None:
        raise ScheduleError(f"{where}: {_EXPECTED}.")
    stage, kind, micro = int(match[1]), match[2], match[3]
    if kind in _IGNORED:
        if micro:
            raise ScheduleError(f"{where}: {kind} names a stage only ('{stage}{kind}'), no microbatch.")
        return _Other(kind, stage)
    if not micro:
        raise ScheduleError(f"{where}: {kind} needs a microbatch ('{stage}{kind}0').")
    if kind in _COMPUTE:
        return Action(kind, stage, int(micro))
    return _Comm(kind, stage, int(micro))


def _in_fields(err: ScheduleError, fields: list[list[_Field]]) -> ScheduleError:
    """`err` with each `cell k` of a rank (k counts the row's cells) also named by its CSV field,
    where the two differ (idle fields and other actions before it)."""
    at = [[f.index for f in row if isinstance(f.item, (Action, FusedAction))] for row in fields]
    rank = None

    def field(match: re.Match) -> str:
        nonlocal rank
        if match[1] is not None:
            rank = int(match[1])
            return match[0]
        r, k = (int(match[3]), int(match[4])) if match[3] is not None else (rank, int(match[2]))
        cells = at[r] if r is not None and r < len(at) else []
        return match[0] + (f" (CSV field {cells[k]})" if k < len(cells) and cells[k] != k else "")

    message = re.sub(r"rank (\d+)|cell (\d+)|\((\d+), (\d+)\)", field, str(err))
    if isinstance(err, DeadlockError):
        return DeadlockError(message, err.stuck)
    return type(err)(message)


def _check_others(schedule, n: int, fields) -> None:
    for row in fields:
        for f in row:
            if isinstance(f.item, (_Other, _Comm)) and not (
                f.item.stage < schedule.num_stages(n) and schedule.rank_of(f.item.stage, n) == f.rank
            ):
                raise ScheduleError(
                    f"parse_torch_csv: rank {f.rank} field {f.index} ({f.item!r}) names stage "
                    f"{f.item.stage}, which rank {f.rank} does not run; an action goes in the row of "
                    "the rank that holds its stage."
                )


def _links(schedule, n: int) -> tuple[dict[int, int], dict[int, int]]:
    """The transfers between ranks: `forward[p] = c` where stage c on another rank reads stage
    p's output; `backward[c] = p` where stage c sends its input gradient to stage p there."""
    flow: Flow = schedule.flow(n)
    rank = [schedule.rank_of(s, n) for s in range(flow.stages)]
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for links, pairs, what in (
        (forward, [(p, c) for c in range(flow.stages) for p in flow.inputs[c]], "output"),
        (backward, [(c, p) for p in range(flow.stages) for c in flow.gradient_inputs[p]], "input gradient"),
    ):
        for src, dst in pairs:
            if rank[src] == rank[dst]:
                continue
            if src in links or dst in links.values():
                raise ScheduleError(
                    f"PyTorch's CSV: stage {src} sends its {what} to stage {dst} on another rank, but a "
                    f"stage there sends or receives another {what} too; its actions name one neighbour "
                    "per stage, so the stages must form chains."
                )
            links[src] = dst
    return forward, backward


def _check_comms(schedule, n: int, fields) -> None:
    """Raise unless the send and receive actions of `fields` are exactly the transfers of the
    table, each after what it sends and before what reads it, paired in order, without deadlock."""
    forward, backward = _links(schedule, n)
    into = {"F": {c: p for p, c in forward.items()}, "B": {p: c for c, p in backward.items()}}
    out = {"F": forward, "B": backward}
    expected: dict[_Comm, tuple] = {}  # action -> (direction, source stage, destination stage, microbatch)
    for d in "FB":
        for src, dst in out[d].items():
            for mb in schedule.microbatches_of(src, n):
                message = (d, src, dst, mb)
                expected[_Comm(f"SEND_{d}", src, mb)] = expected[_Comm(f"RECV_{d}", dst, mb)] = message
    made: dict[tuple, int] = {}  # Flow.makes of each action -> field index of the cell that runs it
    for row in fields:
        for f in row:
            if isinstance(f.item, (Action, FusedAction)):
                made.update((Flow.makes(a), f.index) for a in f.item.parts)
    seen: dict[_Comm, _Field] = {}
    for row in fields:
        for f in row:
            if isinstance(f.item, _Comm):
                _check_comm(f, expected, seen, made, out, into)
    missing = [c for c in expected if c not in seen]
    if missing:
        c = missing[0]
        raise ScheduleError(
            f"parse_torch_csv: rank {schedule.rank_of(c.stage, n)} lacks {c!r} "
            f"({_describe(c, out, into)}); the form with communication names every transfer "
            "(or leave them all out: the compute-only form)."
        )
    _check_pairing(schedule, n, fields, expected)
    _check_progress(schedule.flow(n), fields, expected)


def _check_comm(f: _Field, expected, seen, made, out, into) -> None:
    c = f.item
    where = f"parse_torch_csv: rank {f.rank} field {f.index} ({c!r})"
    if c not in expected:
        raise ScheduleError(f"{where} is no transfer of the table: {_describe(c, out, into)}.")
    if c in seen:
        raise ScheduleError(f"{where} appears twice (first at field {seen[c].index}).")
    seen[c] = f
    d = c.kind[-1]
    sends = c.kind.startswith("SEND")
    kind = "F" if d == "F" else "G"
    at = made[(kind, c.stage, c.microbatch)]
    cell = "F" if d == "F" else "B or I"
    if sends and at > f.index:
        raise ScheduleError(
            f"{where} comes before the {cell} of stage {c.stage}, microbatch {c.microbatch} (field {at}) "
            "whose result it sends; a send goes after the cell that produces it."
        )
    if not sends and at < f.index:
        raise ScheduleError(
            f"{where} comes after the {cell} of stage {c.stage}, microbatch {c.microbatch} (field {at}) "
            "that reads it; a receive goes before the cell that reads it."
        )


def _describe(c: _Comm, out, into) -> str:
    d = c.kind[-1]
    what = "forward output" if d == "F" else "input gradient"
    if c.kind.startswith("SEND"):
        peer = out[d].get(c.stage)
        return (
            f"stage {c.stage} sends its {what} to stage {peer}"
            if peer is not None
            else f"stage {c.stage} sends its {what} to no stage on another rank"
        )
    peer = into[d].get(c.stage)
    return (
        f"stage {c.stage} receives the {what} of stage {peer}"
        if peer is not None
        else f"stage {c.stage} receives no {what} from another rank"
    )


def _check_pairing(schedule, n: int, fields, expected) -> None:
    """Between two ranks, the receives come in the order of the sends (they pair up in order)."""
    order: dict[tuple[str, int, int], list[tuple[tuple, _Field]]] = {}
    for row in fields:
        for f in row:
            if isinstance(f.item, _Comm):
                msg = expected[f.item]
                pair = (schedule.rank_of(msg[1], n), schedule.rank_of(msg[2], n))
                order.setdefault((f.item.kind[:4], *pair), []).append((msg, f))
    for (verb, src, dst), sends in sorted(order.items()):
        if verb != "SEND":
            continue
        recvs = order.get(("RECV", src, dst), [])
        for (sent, s), (got, r) in zip(sends, recvs):
            if sent != got:
                raise ScheduleError(
                    f"parse_torch_csv: rank {src} sends {s.item!r} (field {s.index}) to rank {dst} where "
                    f"the receive in the same place is {r.item!r} (field {r.index}); sends and receives "
                    "between two ranks pair up in the order they are posted."
                )


def _check_progress(flow: Flow, fields, expected) -> None:
    """Run the rows as PyTorch's simulator does: a receive waits until its send was issued, a
    cell until what it needs was issued; raise `DeadlockError` when every row waits."""
    rows = [[f for f in row if not isinstance(f.item, _Other)] for row in fields]
    at = [0] * len(rows)
    done: set = set()
    sent: set = set()
    moved = True
    while moved:
        moved = False
        for r, row in enumerate(rows):
            while at[r] < len(row) and _ready(row[at[r]].item, flow, done, sent, expected):
                item = row[at[r]].item
                if isinstance(item, _Comm):
                    if item.kind.startswith("SEND"):
                        sent.add(expected[item])
                else:
                    done.update(Flow.makes(a) for a in item.parts)
                at[r] += 1
                moved = True
    stuck = [row[at[r]] for r, row in enumerate(rows) if at[r] < len(row)]
    if stuck:
        raise DeadlockError(
            "parse_torch_csv: the rows deadlock when each receive waits for its send: "
            + "; ".join(f"rank {f.rank} waits at field {f.index} ({_show(f.item)})" for f in stuck)
            + ". Move the receives so that each one's send can be issued before it is reached."
        )


def _ready(item, flow: Flow, done: set, sent: set, expected) -> bool:
    if isinstance(item, _Comm):
        return item.kind.startswith("SEND") or expected[item] in sent
    return all(need in done for a in item.parts for need in flow.needs(a))


def _show(item) -> str:
    return _token(item) if isinstance(item, (Action, FusedAction)) else repr(item)


def read_torch_csv(source) -> UserSchedule:
    """`parse_torch_csv` of the file `source` (a path or a text file), as a `UserSchedule`."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, newline="") as f:
            return read_torch_csv(f)
    if not hasattr(source, "read"):
        raise TypeError(f"read_torch_csv: source must be a path or a text file, not {type(source).__name__}.")
    return UserSchedule(parse_torch_csv(source.read()))
