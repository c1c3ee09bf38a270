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
    assert len(BLOCKS) >= 3


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
    command = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q'
    assert command in text
    assert 'pip install -q -e ".[test]" && python -m pytest -q' in (README.parent / ".ci" / "run").read_text()
