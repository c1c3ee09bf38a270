"""The measured list of slow tests: written from a JUnit report, naming tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

from slow_tests import LIST, OVER, main, measured_slow, read_list

ROOT = Path(__file__).resolve().parents[1]
REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4" time="30">
<testcase classname="tests.mpmd.test_a" name="test_quick" time="0.2" />
<testcase classname="tests.mpmd.test_a" name="test_slow[Std1F1B-n4]" time="12.5" />
<testcase classname="tests.test_b" name="test_at_the_bound" time="5.0" />
<testcase classname="tests.test_b" name="test_just_under" time="4.99" />
</testsuite></testsuites>"""


def test_the_tests_at_the_bound_or_over_are_listed_by_node_id(tmp_path):
    report = tmp_path / "suite.xml"
    report.write_text(REPORT)
    quick = tmp_path / "quick.xml"
    quick.write_text(REPORT.replace('time="0.2"', 'time="7"').replace("12.5", "0.1"))
    assert measured_slow([quick], over=5.0) == [
        "tests/mpmd/test_a.py::test_quick",
        "tests/test_b.py::test_at_the_bound",
    ]
    assert measured_slow([report, quick], over=5.0) == [
        "tests/mpmd/test_a.py::test_quick",
        "tests/mpmd/test_a.py::test_slow[Std1F1B-n4]",
        "tests/test_b.py::test_at_the_bound",
    ]
    out = tmp_path / "slow.txt"
    main([str(report), "--over", "10", "--out", str(out)])
    assert out.read_text().startswith("#")
    assert read_list(out) == {"tests/mpmd/test_a.py::test_slow[Std1F1B-n4]"}


def test_every_listed_test_is_defined():
    """A listed test that was renamed or removed would silently leave the quick loop; refresh the
    list with `python tests/slow_tests.py REPORT` (its docstring says how)."""
    listed = sorted(read_list())
    sources = {path: ROOT / path for path in {node.split("::")[0] for node in listed}}
    texts = {path: source.read_text() for path, source in sources.items() if source.is_file()}
    missing = []
    for node in listed:
        path, name = node.split("::")
        function = re.escape(re.sub(r"\[.*\]$", "", name))
        if not re.search(rf"^def {function}\(", texts.get(path, ""), re.MULTILINE):
            missing.append(node)
    assert listed and not missing, f"{LIST.name} names tests that are not defined: {missing}"


def test_the_readme_states_the_bound_the_list_uses():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"measured at {OVER:g} s or more" in readme
