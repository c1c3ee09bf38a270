"""Which tests are marked `slow`: those the suite's runs measured at `OVER` seconds or more.

`pytest -m "not slow"` leaves them out for a quick loop (CI runs every test). The list is measured,
not guessed: a run's JUnit report gives each test's seconds (setup, call and teardown), and this
script writes the node ids of those at `OVER` seconds or more in any of the reports it is given
to `slow_tests.txt`, which `conftest.py` reads at collection. Give it a whole run's report and
the quick loop's: a test sharing a module's fixture with a slow one builds that fixture itself
once the slow one is left out. Refresh it after a change that makes tests slower or faster:

    python -m pytest -q --junitxml runs/suite.xml
    python -m pytest -q -m "not slow" --junitxml runs/quick.xml
    python tests/slow_tests.py runs/suite.xml runs/quick.xml
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

LIST = Path(__file__).with_name("slow_tests.txt")
OVER = 5.0  # seconds, on the 2-core machine
HEADER = (
    "# Tests marked slow (tests/slow_tests.py wrote this list from runs' JUnit reports: each test\n"
    '# at {over:g} s or more on 2 cores in one of them). `python -m pytest -m "not slow"` leaves them out.\n'
)


def node_id(testcase: ET.Element) -> str:
    """A JUnit test case's pytest node id (`tests/dir/test_file.py::test_name[params]`)."""
    module = testcase.get("classname", "").replace(".", "/")
    return f"{module}.py::{testcase.get('name')}"


def measured_slow(reports: list[Path], over: float = OVER) -> list[str]:
    """The node ids of the tests that took `over` seconds or more in any of the reports, sorted."""
    cases = (case for report in reports for case in ET.parse(report).getroot().iter("testcase"))
    return sorted({node_id(case) for case in cases if float(case.get("time", 0)) >= over})


def read_list(path: Path = LIST) -> set[str]:
    """The node ids in a list written by `main` (comment lines left out)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="JUnit XML reports of runs of the suite")
    parser.add_argument("--over", type=float, default=OVER, help="seconds from which a test is slow")
    parser.add_argument("--out", type=Path, default=LIST)
    args = parser.parse_args(argv)
    slow = measured_slow(args.reports, args.over)
    args.out.write_text(HEADER.format(over=args.over) + "".join(f"{node}\n" for node in slow))
    print(f"{len(slow)} tests at {args.over:g} s or more -> {args.out}")


if __name__ == "__main__":
    main()
