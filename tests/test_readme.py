"""Every Python code block of the README runs as written, each in a fresh interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1  # the heterogeneous pipeline; the guides in docs/ hold the rest


def test_the_readme_and_the_docs_index_link_existing_pages():
    """Every relative link of the README and of docs/README.md (guides, then reference, then
    measurements) names a file that exists."""
    for page in (README, README.parent / "docs" / "README.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: {target}"


def test_the_docs_index_lists_guides_then_reference_then_measurements():
    text = (README.parent / "docs" / "README.md").read_text()
    assert text.index("## Guides") < text.index("## Reference") < text.index("## Measurements")
    listed = set(re.findall(r"\]\(([\w-]+\.md)", text))
    pages = {p.name for p in (README.parent / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"pages the index does not list: {sorted(pages - listed)}"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    script = tmp_path / f"block_{index}.py"
    script.write_text(BLOCKS[index])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_quick_start_installs_what_each_command_uses():
    """The main job's command installs the `examples` extra (progress bar, plots); the test
    command is the one CI runs."""
    import tomllib

    text = README.read_text()
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert 'pip install -e ".[examples]" && python examples/train_lm.py' in text
    assert {"tqdm", "matplotlib"} <= {re.split(r"[<>=]", dep)[0] for dep in extras["examples"]}
    venv = "python3 -m venv .venv && . .venv/bin/activate"
    command = f'{venv} && pip install -e ".[test]" && python -m pytest -q'
    assert command in text
    assert 'pip install -q -e ".[test]" && python -m pytest -q' in (README.parent / ".ci" / "run").read_text()


def _chooser():
    import importlib.util

    path = README.parent / "docs" / "schedule_chooser.py"
    spec = importlib.util.spec_from_file_location("schedule_chooser", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_schedule_chooser_is_current_and_lists_every_shipped_schedule():
    """The README's chooser is the one `docs/schedule_chooser.py` computes (rewrite it with
    `--write`), one row per shipped schedule; 1F1B's bubble is the closed form (n-1)/(m+n-1)."""
    from spectrax_core import schedules as S

    chooser = _chooser()
    assert chooser.current(README.read_text()) == chooser.table()
    rows = {r.name: (r.bubble, r.memory) for r in chooser.rows()}
    assert set(rows) == {cls.__name__ for cls in (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES)}
    n, m = chooser.RANKS, chooser.MICROBATCHES
    assert abs(rows["Std1F1B"][0] - (n - 1) / (m + n - 1)) < 1e-12 and rows["Std1F1B"][1] == 1.0
    assert rows["GPipe"][1] == m / n  # GPipe holds all m microbatches, 1F1B at most n


def test_the_choosers_memory_columns_are_the_simulators_count_and_its_weight_by_layers():
    """`peak` is `simulate(...).peak_activations` as it reads; `× 1F1B` is that count with each
    activation weighed by its stage's share of a rank's layers (1/v), over Std1F1B's; cells are
    every rank's actions."""
    from spectrax_core import schedules as S

    chooser = _chooser()
    rows = {r.name: r for r in chooser.rows()}
    base = rows["Std1F1B"].peak
    for cls in (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES):
        schedule, row = chooser.instance(cls), rows[cls.__name__]
        v = schedule.num_stages(chooser.RANKS) // chooser.RANKS if cls.layout != "flat" else 1
        assert row.peak == max(S.simulate(schedule, chooser.RANKS).peak_activations)
        assert row.memory == pytest.approx(row.peak / v / base)
        assert row.cells == sum(map(len, schedule.actions(chooser.RANKS)))
    assert rows["ZBV"].peak == 2 * base and rows["ZBV"].memory == 1.0  # twice the count, half a rank each


def test_the_choosers_assumptions_decide_its_ranking():
    """The chooser ranks ZBV above Std1F1B with ranks computing in parallel and cells costing only
    their arithmetic. The planner's step model (`spectrax_mpmd._planner.shared`, which `mp.advise`
    predicts with) on the same cells, per layer (a stage of v per rank costs 1/v), agrees there; with
    the 4 ranks sharing 2 compute units (CPU devices) ZBV's gain shrinks to under a third; and a cell
    issue cost turns the order: a quarter of a rank's forward per cell on parallel ranks, a twentieth
    on shared units."""
    from spectrax_core import schedules as S
    from spectrax_core.schedules import StageCost
    from spectrax_mpmd._planner.shared import shared_makespan

    chooser = _chooser()
    n = chooser.RANKS

    def gain(units, issue, shares):
        """How much shorter ZBV's step is than Std1F1B's, as a share of Std1F1B's."""
        steps = []
        for cls in (S.ZBV, S.Std1F1B):
            schedule = chooser.instance(cls)
            stages, share = schedule.num_stages(n), chooser.layer_share(schedule)
            cost = StageCost(*((t * share,) * stages for t in (1.0, 2.0, 1.0, 1.0)))
            steps.append(shared_makespan(schedule, n, cost, units, issue, shares))
        return 1 - steps[0] / steps[1]

    rows = [r.name for r in sorted(chooser.rows(), key=lambda r: r.bubble)]
    assert rows.index("ZBV") < rows.index("Std1F1B") and gain(n, 0.0, False) > 0.2
    assert 0 <= gain(2, 0.0, True) < gain(n, 0.0, False) / 3
    assert gain(n, 0.25, False) < 0 and gain(2, 0.05, True) < 0
