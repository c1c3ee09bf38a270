"""Every measured figure quoted in README.md and docs/ is marked and equals its record
(`docs/measurements/*.json`, written by `benchmarks/figures.py record`); `figures.py write` refreshes
them together, so a number edited by hand, or a record re-measured without rewriting the text,
fails here. Any other time, rate, size, ratio or percentage a page states (in prose, tables, pasted
output in code blocks or Python comments) is an amount it sets or one a test here derives."""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _figures():
    spec = importlib.util.spec_from_file_location("figures", ROOT / "benchmarks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


figures = _figures()
RECORDS = figures.load_records()
PAGES = figures.pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_marked_figure_equals_its_record(page):
    assert figures.problems(page.read_text(), RECORDS) == []


def test_the_main_jobs_figures_are_marked():
    """The README quotes the main job's run and the suite's duration from their records."""
    used = {record for record, _, _ in figures.uses()}
    assert {"train_lm", "test_suite"} <= used
    assert used <= set(RECORDS)


def test_a_number_edited_by_hand_fails_and_write_restores_it():
    text = (ROOT / "README.md").read_text()
    marker = next(figures.MARKER.finditer(text))
    edited = text.replace(marker[0], marker[0].replace(f"-->{marker['value']}<", f"-->{marker['value']}1<"))
    assert len(figures.problems(edited, RECORDS)) == 1
    assert figures.rewrite(edited, RECORDS) == text


def test_a_record_measured_again_without_rewriting_the_text_fails():
    measured = RECORDS["train_lm"]["figures"]
    text = "<!-- fig train_lm round({tokens_per_s}, -2) ,.0f -->0<!-- /fig -->"
    rewritten = figures.rewrite(text, RECORDS)
    again = {**RECORDS, "train_lm": {**RECORDS["train_lm"]}}
    again["train_lm"]["figures"] = {**measured, "tokens_per_s": measured["tokens_per_s"] * 2}
    assert figures.problems(rewritten, RECORDS) == [] and len(figures.problems(rewritten, again)) == 1


@pytest.mark.parametrize(
    "marker, error",
    [
        ("<!-- fig train_lm {no_such_key} .1f -->1.0<!-- /fig -->", "no figure 'no_such_key'"),
        ("<!-- fig no_such_record {wall_s} .1f -->1.0<!-- /fig -->", "no record 'no_such_record'"),
        ("<!-- fig train_lm __import__('os') .1f -->1.0<!-- /fig -->", "only {key}"),
    ],
)
def test_a_marker_naming_what_no_record_holds_fails(marker, error):
    (found,) = figures.problems(marker, RECORDS)
    assert error in found


def test_expressions_and_formats_as_the_text_writes_them():
    data = {"x": 11873.2, "t": 972.0, "r": 0.338}
    assert format(figures.evaluate("round({x}, -2)", data), ",.0f") == "11,900"
    assert figures.evaluate("{t} // 60", data) == 16 and figures.evaluate("{t} % 60", data) == 12
    assert format(figures.evaluate("{r}", data), ".0%") == "34%"


def test_records_say_when_where_and_how():
    for name, data in RECORDS.items():
        assert name in figures.SOURCES, f"{name}: no command in figures.SOURCES produces it"
        assert data["date"] and data["machine"] and data["command"] and data["figures"], name


def test_the_measurements_page_is_current():
    """docs/measurements.md is what `figures.py write` generates from the records."""
    page = (ROOT / "docs" / "measurements.md").read_text()
    assert page == figures.measurements_page(RECORDS, figures.uses())
    for name, data in RECORDS.items():
        assert f"## {name}: " in page and data["command"] in page


def test_flatten_names_rows_by_their_name_field():
    rows = {"rows": [{"name": "a", "ms": 1.0}, {"name": "b", "ms": 2.0}], "xs": [3, 4], "note": "text"}
    assert figures.flatten(rows) == {"rows.a.ms": 1.0, "rows.b.ms": 2.0, "xs.0": 3, "xs.1": 4}
    sizes = [{"size": z, "schedule": s, "ms": 1.0} for z in ("small", "large") for s in ("GPipe", "Std1F1B")]
    keys = {"small.GPipe.ms", "small.Std1F1B.ms", "large.GPipe.ms", "large.Std1F1B.ms"}
    assert set(figures.flatten(sizes)) == keys
    mixed = [{"section": "step", "schedule": s, "ms": 1.0} for s in ("GPipe", "Std1F1B")]
    mixed.append({"section": "memory", "donate": True, "b": 2})
    named = {"GPipe.step.ms", "Std1F1B.step.ms", "True.memory.b", "True.memory.donate"}
    assert set(figures.flatten(mixed)) == named


NUMBER = r"(?<![\w.=+\-−])\d(?:[\d,.]*\d)?"  # 2, 1.5, 11,900; not 0.10.x, norm1 x, r+1 × (...)
FIGURES = re.compile(
    NUMBER
    + r"(?:\s?(?:ms|µs|us|s|min|minutes|tokens/s|MiB|GiB|KiB|MB|GB)\b"  # a time, rate or size
    + r"|\s?×(?!\s?\d)|x(?![\w×]|\s?\d)"  # a ratio, 2.4× or 0.5x (not a shape, 32 × 8)
    + r"|\s?%)"  # a percentage
)
BLOCK = re.compile(r"```(\w*)\n(.*?)```", flags=re.S)
# tables a test computes and keeps current (tests/test_readme.py: the schedule chooser)
GENERATED = re.compile(r"<!-- schedule chooser: start -->.*?<!-- schedule chooser: end -->", flags=re.S)
# amounts that are set or derived, not measured: targets, a test's tolerance, a benchmark's
# threshold, a budget, a timeout, a message size, a model's size in bytes
SET_AMOUNTS = {
    "multihost.md": {"2 s", "10 s", "1 MiB", "30 s", "300 s", "4 MiB", "0.5x", "0.25x"},  # 0.5x: 1 / processes
    "checkpoints.md": {"13.4 MB", "12 MB"},
    "planner.md": {"4 MiB", "5%", "15%", "60%", "25%", "70%", "10%", "1.5×", "3x"},
    "large-models.md": {"64 MiB"},  # the default batch bound of a restore
    "eager.md": {"50 µs", "1.10×", "2×", "5 %"},  # targets; tests/core/test_fp8.py's tolerance
    "migrating.md": {"95 %"},  # the compatibility test's threshold
    "mpmd.md": {"100 %"},  # "a share near 100 %": the host-bound end of the scale
    "README.md": {"5 s"},  # the bound of the measured slow tests (tests/slow_tests.py)
}


def readable(text: str) -> str:
    """What a reader takes for stated figures: the page without markers and generated tables,
    its code blocks other than Python whole (pasted output), and the comments of Python ones."""
    blocks: list[str] = []

    def code(block: re.Match) -> str:
        lines = block[2].splitlines()
        if block[1] == "python":
            lines = [line.split("#", 1)[1] for line in lines if "#" in line]
        blocks.extend(lines)
        return ""

    prose = BLOCK.sub(code, GENERATED.sub("", figures.MARKER.sub("", text)))
    return "\n".join([prose, *blocks])


@functools.cache
def simulated_bubbles(n: int = 8, m: int = 32) -> dict[str, float]:
    """Each shipped schedule's bubble fraction, simulated at unit costs on `n` ranks with `m`
    microbatches: the figures of schedules.md's table."""
    from spectrax_core import schedules as S

    shipped = (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES)
    return {cls.__name__: S.simulate(cls(microbatches=m), n).bubble_fraction for cls in shipped}


def percent(fraction: float) -> str:
    return f"{fraction * 100:.1f} %"


def derived(page: str) -> set[str]:
    """The figures a page derives and a test computes here: schedules.md's simulated bubbles (its
    table, VMin at n = 16, m = 64, and the published 2n/3m at n = 8, m = 32)."""
    if page != "schedules.md":
        return set()
    bubbles = [*simulated_bubbles().values(), simulated_bubbles(16, 64)["VMin"], 2 * 8 / (3 * 32)]
    return {percent(b) for b in bubbles}


def test_the_schedules_bubble_column_is_the_simulators():
    table = (ROOT / "docs" / "schedules.md").read_text()
    rows = re.findall(r"^\| ([\w, ]+) \| [^|]+ \| ([\d.]+ %)", table, flags=re.M)
    named = {name: value for names, value in rows for name in names.split(", ")}
    assert named == {name: percent(b) for name, b in simulated_bubbles().items()}


def unmarked(text: str, page: str) -> set[str]:
    """The measured-looking figures of `text` (page `page`) that are neither marked nor set."""
    if page == "measurements.md":  # the records themselves
        return set()
    return set(FIGURES.findall(readable(text))) - SET_AMOUNTS.get(page, set()) - derived(page)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_unmarked_measured_figure(page):
    """A page states no time, rate, size, ratio or percentage, in its prose, its tables or its
    code blocks, but its marked figures (each equal to its record), the amounts it sets and the
    ones a test derives: every measured one is a marked figure."""
    assert unmarked(page.read_text(), page.name) == set()


PLANTED = {
    "a time and a rate": "A step took 25.9 s (11,900 tokens/s).",
    "a ratio in prose": "The one-plan step was measured 2.4× faster than two calls.",
    "a ratio written with x": "It issued 0.62x of the cells.",
    "a percentage": "The prediction was off by up to 13% on the last rank.",
    "pasted output": "```text\nstep: issue 1.91 ms CPU of 4.85 ms wall (39% issuing)\n```",
    "a Python comment": "```python\nstep(params)  # 4.85 ms here\n```",
    "an edited set amount": "holds the median prediction within 17% of the median measured",
    "an edited simulated bubble": "| GPipe | flat | 27.9 % | m | never for training at scale |",
}
NOT_FIGURES = [
    "a batch of 32 × 8 tokens on `fsdp=2 x tp=2`, `x + attn(norm1 x)`, r+1 × (B1, B0), JAX 0.10.x",
    "<!-- fig train_lm {wall_s} .1f -->54.5<!-- /fig --> s, <!-- fig x {a} .2f -->1.29<!-- /fig -->×",
    "```python\nx = (a % 10) * 2  # the last block does 3x the others' work\n```",
    "<!-- schedule chooser: start -->\n| ZBV | 6% | 1.00× |\n<!-- schedule chooser: end -->",
    "| GPipe | flat | 17.9 % | m | never for training at scale |",
]


@pytest.mark.parametrize("planted", PLANTED)
def test_the_unmarked_figure_check_finds_a_planted_one(planted):
    assert unmarked(PLANTED[planted], "planner.md" if "set" in planted else "schedules.md")


@pytest.mark.parametrize("text", NOT_FIGURES)
def test_shapes_versions_marked_generated_and_derived_figures_pass(text):
    assert unmarked(text, "planner.md" if "3x" in text else "schedules.md") == set()


def test_a_command_runs_with_its_leading_environment_words_set():
    argv, env = figures.command_environment("JAX_PLATFORMS=tpu python benchmarks/dispatch.py --rounds 3")
    assert argv == [sys.executable, "benchmarks/dispatch.py", "--rounds", "3"]
    assert env["JAX_PLATFORMS"] == "tpu"
    assert figures.command_environment("python -m pytest -o addopts=")[0][-1] == "addopts="
