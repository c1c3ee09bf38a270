"""Every page of `docs/` runs as written: its Python code blocks, in order, as one script in a fresh
interpreter (8 fake CPU devices, as in the rest of the suite). Every other block names its
language (`bash` for commands, `text` for output), so none is skipped unnoticed. A page that joins
a `jax.distributed` job (`mp.initialize`, which JAX's cluster detection can turn into a job of
processes talking through a socket) is skipped, saying why, on a machine that allows no socket."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launching import skip_without_sockets

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
LANGUAGES = {"python", "bash", "text"}
# pages that profile and compile several pipelines (a minute or more on two cores)
SLOW_PAGES = {"planner.md", "decode.md", "ranks.md"}
JOINS = re.compile(r"\bmp\.initialize\(")  # a page whose script joins a jax.distributed job


def python_blocks(page: Path) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == "python"]


RUNNABLE = [page for page in PAGES if python_blocks(page)]


def test_docs_have_runnable_pages():
    assert len(RUNNABLE) >= 7


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_block_names_its_language(page):
    languages = [lang for lang, _ in FENCE.findall(page.read_text())]
    assert set(languages) <= LANGUAGES, f"{page.name}: blocks in {sorted(set(languages) - LANGUAGES)}"


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p for p in RUNNABLE],
    ids=[p.name for p in RUNNABLE],
)
def test_docs_page_runs(page, tmp_path):
    code = "\n".join(python_blocks(page))
    if JOINS.search(code):
        skip_without_sockets()
    script = tmp_path / f"{page.stem}.py"
    script.write_text(code)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_machine_without_sockets_skips_the_pages_that_join_a_job(monkeypatch):
    """Where binding a loopback socket fails (errno 97 in a sandbox), the probe says so and the
    pages that join a job are skipped with that reason; the others run."""
    import launching

    def refused(*args, **kwargs):
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(launching.socket, "socket", refused)
    monkeypatch.setattr(launching, "sockets_available", launching.sockets_available.__wrapped__)
    with pytest.raises(pytest.skip.Exception, match="allows no TCP socket, not even on the loopback"):
        launching.skip_without_sockets()
    assert [p.name for p in RUNNABLE if JOINS.search("\n".join(python_blocks(p)))] == ["multihost.md"]
