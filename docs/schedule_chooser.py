"""The README's schedule chooser, computed from the schedules' own simulator.

Every shipped schedule (`ALL_SCHEDULES` and `MORE_SCHEDULES`) is simulated on 4 ranks
and 8 microbatches at the unit costs (T_F = T_I = T_W = 1, T_B = 2): its bubble, and its
peak activation memory per rank relative to 1F1B's (a stage of a layout with v stages
per rank holds 1/v of a rank's layers, so its activations count 1/v). `tests/test_readme.py`
fails when the README's table differs from this one; `python docs/schedule_chooser.py
--write` rewrites it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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


def instance(cls) -> S.Schedule:
    """`cls` at the chooser's microbatches; loop layouts with two stages per rank."""
    if cls.layout == "loop":
        return cls(microbatches=MICROBATCHES, virtual_stages=2)
    return cls(microbatches=MICROBATCHES)


def _memory(schedule, timeline) -> float:
    per_stage = 1 / schedule.virtual_stages if schedule.layout != "flat" else 1.0
    return max(timeline.peak_activations) * per_stage


def rows() -> list[tuple[str, str, float, float, str]]:
    """`(name, stages per rank, bubble, peak activations x 1F1B's, when)` per shipped schedule."""
    base = _memory(S.Std1F1B(MICROBATCHES), S.simulate(S.Std1F1B(MICROBATCHES), RANKS))
    out = []
    for cls in (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES):
        schedule = instance(cls)
        timeline = S.simulate(schedule, RANKS)
        stages = schedule.num_stages(RANKS) // RANKS
        layout = "1" if cls.layout == "flat" else f"{stages} ({cls.layout})"
        memory = _memory(schedule, timeline) / base
        out.append((cls.__name__, layout, timeline.bubble_fraction, memory, WHEN[cls.__name__]))
    return out


def table() -> str:
    """The chooser as a Markdown table, fastest first."""
    head = [
        f"Simulated on {RANKS} ranks, {MICROBATCHES} microbatches, unit costs (T_F = T_I = T_W = 1, "
        "T_B = 2); activations relative to 1F1B's, per rank.",
        "",
        "| schedule | stages per rank | bubble | activations | pick it when |",
        "|---|---|---|---|---|",
    ]
    body = [
        f"| `{name}` | {layout} | {bubble:.0%} | {memory:.2f}× | {when} |"
        for name, layout, bubble, memory, when in sorted(rows(), key=lambda r: (round(r[2], 4), r[3]))
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
