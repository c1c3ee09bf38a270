"""Programs written for the seed library (`tests/eager/seed_programs/`) run here with only the
import changed (`spectrax` -> `spectrax_eager`), and print what the seed library printed
(recorded next to each program as JSON; floats within a tolerance)."""

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
from seed_compat import differences

HERE = Path(__file__).resolve().parent / "seed_programs"
IMPORT = re.compile(r"^(\s*)(from|import) spectrax\b", re.MULTILINE)
SLOW = {"decode_loop", "guide_gpt2", "guide_llama3", "lora_injection"}  # over 2 s each on CPU
PROGRAMS = sorted(p.stem for p in HERE.glob("*.py") if p.name != "record.py" and not p.name.startswith("_"))


def ours(source: str) -> str:
    """The program with its `spectrax` imports changed to this project's eager package."""
    return IMPORT.sub(r"\1\2 spectrax_eager", source)


def run(name: str) -> dict:
    path = HERE / f"{name}.py"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(ours(path.read_text()), str(path), "exec"), {"__name__": "__main__"})  # noqa: S102
    return json.loads(out.getvalue().strip().splitlines()[-1])


def test_the_import_change_and_the_comparison_can_fail():
    assert ours("import spectrax as spx\nfrom spectrax import nn\nimport spectraxx") == (
        "import spectrax_eager as spx\nfrom spectrax_eager import nn\nimport spectraxx"
    )
    assert differences({"a": [1.0, 2]}, {"a": [1.00001, 2]}) == []
    assert differences({"a": [1.1, 2]}, {"a": [1.0, 2]})
    assert differences({"a": 1}, {"a": 1.0 + 1e-9}) == []
    assert differences({"a": True}, {"a": 1})
    assert differences({"a": [1]}, {"a": [1, 2]})
    assert differences({"a": 1}, {"b": 1})


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in PROGRAMS]
)
def test_program_prints_what_the_seed_library_printed(name):
    want = json.loads((HERE / f"{name}.json").read_text())
    assert differences(run(name), want) == []
