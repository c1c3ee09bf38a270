"""Every measured figure quoted in README.md and docs/ is marked and equals its record
(`docs/measurements/*.json`, written by `benchmarks/figures.py record`); `figures.py write` refreshes
them together, so a number edited by hand, or a record re-measured without rewriting the text,
fails here."""

from __future__ import annotations

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


UNITS = re.compile(r"\d[\d,.]*\s?(?:ms|µs|s|min|minutes|tokens/s|MiB|GiB|KiB|MB|GB)\b")
# amounts that are set, not measured: timeouts, message sizes, a model's size in bytes
SET_AMOUNTS = {
    "multihost.md": {"2 s", "1 MiB", "30 s", "300 s", "4 MiB"},
    "checkpoints.md": {"13.4 MB", "12 MB"},
    "planner.md": {"4 MiB"},
    "large-models.md": {"64 MiB"},  # the default batch bound of a restore
    "eager.md": {"50 µs"},  # a target
}


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_no_unmarked_measured_figure(page):
    """Outside code blocks and markers a page states no time, rate or size but the amounts it sets
    (a timeout, a message size): every measured one is a marked figure."""
    text = figures.MARKER.sub("", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    found = set(UNITS.findall(text)) if page.name != "measurements.md" else set()
    assert found <= SET_AMOUNTS.get(page.name, set())


def test_the_unmarked_figure_check_finds_a_planted_one():
    planted = "A step took 25.9 s (11,900 tokens/s); <!-- fig train_lm {wall_s} .1f -->1.0<!-- /fig --> s."
    assert set(UNITS.findall(figures.MARKER.sub("", planted))) == {"25.9 s", "11,900 tokens/s"}
