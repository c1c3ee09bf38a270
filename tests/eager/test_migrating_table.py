"""The name-by-name tables of docs/migrating.md against the recorded seed interface
(tests/eager/data/seed_interface.tsv) and the seed library's recorded behaviour
(tests/eager/data/seed_probes.json): every recorded name has one row; a name stated "same"
exists here with a signature accepting the seed's calls and behaves as the probes recorded;
"differs" exists; "absent" does not."""

import json
import re
from pathlib import Path

import pytest
import seed_compat
import seed_probes

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


PROBED = json.loads(seed_probes.DATA.read_text())


def test_same_rows_behave_as_the_seed_library():
    """Every row stated *same* is what the seed's name is (a class, a callable, a module, a value:
    the same value; an exception: the same builtin errors) and, where a probe is written (layers'
    output shapes, functions' values, transforms' results, States' shapes, iteration order), gives
    the seed library's result (recorded by `seed_probes.py` in data/seed_probes.json)."""
    lib = seed_probes.library("spectrax_eager")
    same = [(m, n) for (m, n), status in TABLE.items() if status == "same"]
    got = seed_probes.run_all(lib, same)
    for key, result in got.items():  # an error class may also be a builtin error the seed's is not
        errors, wanted = result["generic"].get("is"), PROBED[key]["generic"].get("is")
        if errors is not None and wanted is not None and set(wanted) <= set(errors):
            result["generic"]["is"] = wanted
    wrong = {key: d for key in got if (d := seed_compat.differences(got[key], PROBED[key]))}
    assert not wrong, wrong
    probed = sum("probe" in got[k] for k in got)
    assert probed >= 100, probed


def test_the_probes_can_fail():
    assert seed_probes.generic(ValueError) == {"kind": "class", "is": ["ValueError"]}
    assert seed_probes.generic((1, "a")) == {"kind": "value", "value": [1, "a"]}
    assert seed_compat.differences({"probe": [[2, 3], "float32"]}, {"probe": [[3, 2], "float32"]})
