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
    rows = {name: (bubble, memory) for name, _, bubble, memory, _ in chooser.rows()}
    assert set(rows) == {cls.__name__ for cls in (*S.ALL_SCHEDULES, *S.MORE_SCHEDULES)}
    n, m = chooser.RANKS, chooser.MICROBATCHES
    assert abs(rows["Std1F1B"][0] - (n - 1) / (m + n - 1)) < 1e-12 and rows["Std1F1B"][1] == 1.0
    assert rows["GPipe"][1] == m / n  # GPipe holds all m microbatches, 1F1B at most n
