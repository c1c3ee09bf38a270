"""The README's schedule chooser, computed from the schedules' own simulator.

Every shipped schedule (`ALL_SCHEDULES` and `MORE_SCHEDULES`) is simulated on 4 ranks
and 8 microbatches at the unit costs (T_F = T_I = T_W = 1, T_B = 2), each rank on a device
of its own and a cell costing its arithmetic alone: its cells per step, its bubble, its peak
live activations per rank as `simulate(...).peak_activations` counts them ((stage,
microbatch) activations), and that peak relative to 1F1B's with each activation weighed by
its stage's share of a rank's layers (a layout with v stages per rank: 1/v). The table says
what it assumes and when to rank with `mp.advise` instead; `tests/test_readme.py` checks
both units and that the assumptions decide the ranking, and fails when the README's table
differs from this one; `python docs/schedule_chooser.py --write` rewrites it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

from spectrax_core import schedules as S

RANKS, MICROBATCHES = 4, 8
README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- schedule chooser: start -->", "<!-- schedule chooser: end -->"

# when to pick each one (the figures beside it are computed)
WHEN = {
    "GPipe": "the simplest order; it holds every microbatch's activations",
    "Std1F1B": "the default: activations bounded by the rank count",
    "Eager1F1B": "slow transfers: a longer warm-up hides them, at more memory",
    "ZeroBubbleH1": "the backward splits into I and W: a smaller bubble at 1F1B's memory",
    "ZeroBubbleH2": "transfer latency to hide: ZB-H1 with a longer warm-up, at more memory",
    "InterleavedH1": "a smaller bubble from v stages per rank, at more transfers",
    "InterleavedGPipe": "interleaving in GPipe's order (GPipe's memory)",
    "Interleaved1F1BPlusOne": "interleaved 1F1B with one more warm-up forward to hide a transfer",
    "KimiK2": "interleaving with each steady F/B pair fused into one overlapped cell",
    "DualPipeV": "a V of two stages per rank with fused F&B cells (compute overlaps transfers)",
    "ZBV": "the smallest bubble at 1F1B's memory: I and W split on a V",
    "VHalf": "less activation memory than 1F1B and a smaller bubble",
    "VMin": "the least activation memory, for a larger bubble than the other V's",
    "DualPipe": "two opposite pipelines over two copies of the model (twice the parameters)",
}


class Row(NamedTuple):
    """One schedule's line: its name, stages per rank (and layout), cells per step (every rank's,
    a fused cell counted once), bubble, peak live (stage, microbatch) activations over the ranks,
    that peak weighed by layers relative to Std1F1B's, and when to pick it."""

    name: str
    layout: str
    cells: int
    bubble: float
    peak: int
    memory: float
    when: str


def instance(cls) -> S.Schedule:
    """`cls` at the chooser's microbatches; loop layouts with two stages per rank."""
    if cls.layout == "loop":
        return cls(microbatches=MICROBATCHES, virtual_stages=2)
    return cls(microbatches=MICROBATCHES)


def layer_share(schedule) -> float:
    """The share of a rank's layers one stage of `schedule` holds: 1/v for v stages per rank."""
    return 1.0 if schedule.layout == "flat" else 1 / (schedule.num_stages(RANKS) // RANKS)


def rows() -> list[Row]:
    """One `Row` per shipped schedule."""
    base = S.Std1F1B(MICROBATCHES)
    base_peak = max(S.simulate(base, RANKS).peak_activations) * layer_share(base)
    out = []
    for cls in (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES):
        schedule = instance(cls)
        timeline = S.simulate(schedule, RANKS)
        stages = schedule.num_stages(RANKS) // RANKS
        layout = "1" if cls.layout == "flat" else f"{stages} ({cls.layout})"
        peak = max(timeline.peak_activations)
        cells = sum(map(len, schedule.actions(RANKS)))
        memory = peak * layer_share(schedule) / base_peak
        out.append(
            Row(cls.__name__, layout, cells, timeline.bubble_fraction, peak, memory, WHEN[cls.__name__])
        )
    return out


ASSUMED = (
    "T_B = 2), assuming each rank computes on a device of its own, in parallel with the others, and a "
    "cell costs its arithmetic alone: no host time to issue it, free transfers. `peak` is "
    "`simulate(...).peak_activations` at its largest over the ranks, counted in (stage, microbatch) "
    "activations; `× 1F1B` weighs each by its stage's share of a rank's layers (1/v for v stages per "
    "rank) and divides by Std1F1B's"
)
TRUST_ADVISE = (
    "The ranking holds where those assumptions do. Where ranks share compute units (fake CPU devices "
    "share the host's cores), a rank's bubble is time the others use, so a smaller bubble gains little; "
    "and every cell costs the one host thread its issue (tens of microseconds), so with short cells a "
    "schedule with more cells per step (split backwards, two stages per rank) loses more than its "
    "bubble wins. There, or with transfers that cost, rank the schedules with `mp.advise`, which "
    "measures your model's cells, their issue cost and how many ranks compute at once."
)


def preamble(by_name: dict) -> list[str]:
    """What the table assumes and how its columns count, then when to rank with `mp.advise`."""
    zbv, base = by_name["ZBV"], by_name["Std1F1B"]
    units = (
        f": ZBV's peak of {zbv.peak} half-rank activations weighs {zbv.memory:.2f}× Std1F1B's "
        f"{base.peak} whole ones."
    )
    setting = f"Simulated on {RANKS} ranks, {MICROBATCHES} microbatches, unit costs (T_F = T_I = T_W = 1, "
    return [setting + ASSUMED + units, "", TRUST_ADVISE]


def table() -> str:
    """The chooser as Markdown: what it assumes, then the table, fastest first."""
    table_rows = rows()
    head = [
        *preamble({r.name: r for r in table_rows}),
        "",
        "| schedule | stages per rank | cells per step | bubble | peak | × 1F1B | pick it when |",
        "|---|---|---|---|---|---|---|",
    ]
    body = [
        f"| `{r.name}` | {r.layout} | {r.cells} | {r.bubble:.0%} | {r.peak} | {r.memory:.2f}× | {r.when} |"
        for r in sorted(table_rows, key=lambda r: (round(r.bubble, 4), r.memory))
    ]
    return "\n".join(head + body) + "\n"


def current(readme: str) -> str:
    """The chooser as the README holds it (between its markers)."""
    start, end = readme.index(START) + len(START), readme.index(END)
    return readme[start:end].strip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the README's table in place")
    if parser.parse_args().write:
        text = README.read_text()
        start, end = text.index(START) + len(START), text.index(END)
        README.write_text(text[:start] + "\n" + table() + text[end:])
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
