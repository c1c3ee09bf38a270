"""The name-by-name tables of docs/migrating.md against the recorded seed interface
(tests/eager/data/seed_interface.tsv): every recorded name has one row; a name stated "same"
exists here with a signature accepting the seed's calls; "differs" exists; "absent" does not."""

import re
from pathlib import Path

import pytest
import seed_compat

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
SECTION = re.compile(r"^### `([\w.]+)`", re.M)
COUNTS = re.compile(r"^### `([\w.]+)`\n\n(\d+) names: (\d+) same, (\d+) differ, (\d+) absent\.$", re.M)
ROW = re.compile(r"^\| `(\w+)` \| (same|differs|absent) \| (.*) \|$", re.M)


def table() -> dict[tuple[str, str], str]:
    """`{(module, name): status}` from the page (every row once)."""
    text = PAGE.read_text()
    out: dict[tuple[str, str], str] = {}
    starts = [(m.start(), m.group(1)) for m in SECTION.finditer(text)]
    for (start, module), (end, _) in zip(starts, starts[1:] + [(len(text), "")]):
        for name, status, _ in ROW.findall(text[start:end]):
            assert (module, name) not in out, f"{module}.{name} has two rows"
            out[(module, name)] = status
    return out


RECORDED = seed_compat.seed_interface()
TABLE = table()


def test_every_recorded_name_has_a_row():
    recorded = {(m, n) for m, n, _, _ in RECORDED}
    assert recorded == set(TABLE), (sorted(recorded - set(TABLE))[:5], sorted(set(TABLE) - recorded)[:5])


@pytest.mark.parametrize("module", sorted(seed_compat.OURS))
def test_rows_state_what_is_here(module):
    wrong = []
    for m, name, kind, sig in RECORDED:
        if m != module:
            continue
        stated = TABLE[(m, name)]
        found, problems = seed_compat.status(m, name, kind, sig)
        if stated == "same" and found != "same":
            wrong.append(f"{name}: stated same, but {found}: {problems}")
        elif stated == "differs" and found == "absent":
            wrong.append(f"{name}: stated differs, but absent")
        elif stated == "absent" and found != "absent":
            wrong.append(f"{name}: stated absent, but present")
    assert not wrong, wrong


def test_the_checker_can_fail():
    strict = seed_compat._parse("(a, b, *, c=...)")
    assert seed_compat.incompatibilities(strict, seed_compat._parse("(a, b, *, c=...)")) == []
    assert seed_compat.incompatibilities(strict, seed_compat._parse("(a, *, c=...)"))  # too few positional
    assert seed_compat.incompatibilities(strict, seed_compat._parse("(a, b)"))  # no keyword c
    assert seed_compat.incompatibilities(strict, seed_compat._parse("(a, b, d, *, c=...)"))  # requires d
    assert seed_compat.incompatibilities(strict, seed_compat._parse("(a, b, **kw)")) == []


def test_coverage_of_the_model_level_modules():
    """Share of the names of `spectrax`, `spectrax.nn` and `spectrax.sharding` present here (any
    status but absent): what a model file, its training loop and its sharding rules use."""
    for module in ("spectrax", "spectrax.nn", "spectrax.sharding"):
        rows = [s for (m, _), s in TABLE.items() if m == module]
        assert sum(s != "absent" for s in rows) / len(rows) >= 0.95, module


def test_signatures_of_the_model_level_modules():
    """Share of those names present here with a signature accepting the seed's calls (what the
    checker finds, whatever the table's notes say about meaning)."""
    for module in ("spectrax", "spectrax.nn", "spectrax.sharding"):
        found = [seed_compat.status(m, n, k, s)[0] for m, n, k, s in RECORDED if m == module]
        assert found.count("same") / len(found) >= 0.95, module


def test_each_section_states_its_counts():
    text = PAGE.read_text()
    for module, total, same, differ, absent in COUNTS.findall(text):
        rows = [s for (m, _), s in TABLE.items() if m == module]
        stated = (int(total), int(same), int(differ), int(absent))
        assert stated == (len(rows), rows.count("same"), rows.count("differs"), rows.count("absent")), module
    assert len(COUNTS.findall(text)) == len(seed_compat.OURS)
