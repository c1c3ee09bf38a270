"""What the packages read back is data: no module unpickles, evaluates or executes anything.

Files the library wrote (profiles, checkpoints' metadata and `extra`) and strings other processes
send (through the `jax.distributed` key-value store) are parsed as JSON or read as arrays. Every
module of the three packages is parsed with `ast`, and each of these is a finding:

* importing a module that turns bytes into arbitrary objects (`pickle` and its kin, `marshal`,
  `shelve`), or JAX's executable (un)pickler (`jax.experimental.serialize_executable`), or
  reaching one by name (`importlib.import_module("pickle")`, `private("...Unpickler")`);
* calling the builtins `eval` or `exec` (a method named so, `model.eval()`, is not one);
* `np.load` (or `numpy.load`) with `allow_pickle` anything but a literal `False` (its default is
  `False`: a call without it is data only).

`EXEMPT` names the modules allowed a finding, and why. Each must keep having one (an exemption
that no longer applies is removed) and must read nothing from a file or another process.
"""

import ast
from pathlib import Path

from test_import_direction import PACKAGES, ROOT

LOADER_MODULES = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve")
EXECUTABLE_UNPICKLER = "jax.experimental.serialize_executable"
BY_NAME = ("import_module", "__import__", "private", "getattr")  # calls that reach a module by its name
BUILTINS = ("eval", "exec")
EXEMPT = {
    # Relocation loads a compiled program onto other devices from the bytes JAX's `serialize`
    # made of it moments before, in this process: the payload lives in memory only
    # (`Serialized.payload`), never written to disk nor received from another process, so
    # nobody else can hand it bytes. Unpickling is how JAX itself reads those bytes back.
    "spectrax_mpmd/_compile/relocate.py": "in-memory relocation of programs this process compiled",
    # A plan's steps are written out as one Python function (`exec` of source made here from the
    # plan's slot and step numbers alone, its callables passed as the function's globals): no
    # text in it comes from a file, another process or the user.
    "spectrax_mpmd/_runtime/straight.py": "a plan's steps as straight-line code, written from slot numbers",
}
# calls that read a file or another process's data (besides `np.load`; `json.load` reads what `open` gives)
READERS = ("open", "read_bytes", "read_text", "fromfile", "memmap", "Exchange", "allgather", "socket")


def _loader_name(name: str) -> bool:
    root = name.split(".")[0]
    return root in LOADER_MODULES or name.startswith(EXECUTABLE_UNPICKLER) or "Unpickler" in name


def _call_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _numpy_load(call: ast.Call) -> bool:
    owner = call.func.value if isinstance(call.func, ast.Attribute) else None
    return _call_name(call) == "load" and isinstance(owner, ast.Name) and owner.id in ("np", "numpy")


def _finding(node: ast.AST) -> str | None:
    """What makes `node` run code from data, or None."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if _loader_name(a.name)]
        return f"imports {', '.join(names)}" if names else None
    if isinstance(node, ast.ImportFrom) and not node.level:
        full = [f"{node.module}.{a.name}" for a in node.names]
        names = [n for n in full if _loader_name(node.module) or _loader_name(n)]
        return f"imports {', '.join(names)}" if names else None
    if not isinstance(node, ast.Call):
        return None
    if isinstance(node.func, ast.Name) and node.func.id in BUILTINS:
        return f"calls {node.func.id}"
    name = _call_name(node)
    if name in BY_NAME:
        named = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found = [n for n in named if _loader_name(n)]
        return f"reaches {', '.join(found)} by name" if found else None
    if _numpy_load(node):
        flag = next((k.value for k in node.keywords if k.arg == "allow_pickle"), None)
        if flag is not None and not (isinstance(flag, ast.Constant) and flag.value is False):
            return "calls np.load with allow_pickle"
    return None


def code_loaders(root: Path, packages=PACKAGES) -> dict[str, list[str]]:
    """`{module path: ["line: finding", ...]}` for every module of `packages` under `root` with one."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = [
                f"{node.lineno}: {what}"
                for node in ast.walk(ast.parse(path.read_text()))
                if (what := _finding(node)) is not None
            ]
            if lines:
                found[str(path.relative_to(root))] = lines
    return found


def readers(path: Path) -> list[str]:
    """Where `path` reads a file or another process's data (a call named like a reader)."""
    return [
        f"{node.lineno}: {_call_name(node)}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and (_call_name(node) in READERS or _numpy_load(node))
    ]


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_loader_of_each_kind_is_found_and_data_only_reads_are_not(tmp_path):
    _plant(
        tmp_path,
        {
            "spectrax_mpmd/_planner/cache.py": "import pickle\n\ndef get(f):\n    return pickle.load(f)\n",
            "spectrax_mpmd/_comm/wire.py": "from pickle import loads\n",
            "spectrax_mpmd/_checkpoint/extra.py": "import numpy as np\nx = np.load('a', allow_pickle=True)\n",
            "spectrax_core/a.py": "import dill\nimport marshal as m\n",
            "spectrax_core/b.py": "y = eval('1 + 1')\nexec('z = 1')\n",
            "spectrax_eager/c.py": "import importlib\npickle = importlib.import_module('pickle')\n",
            "spectrax_eager/d.py": "u = private('jax.experimental.serialize_executable._JaxPjrtUnpickler')\n",
            "spectrax_eager/e.py": "from jax.experimental import serialize_executable\n",
            "spectrax_eager/clean.py": (
                "import json\nimport numpy as np\n\n"
                "def read(model, f):\n"
                "    model.eval()\n"
                "    return json.loads(f.read()), np.load(f), np.load(f, allow_pickle=False)\n"
            ),
        },
    )
    assert code_loaders(tmp_path) == {
        "spectrax_core/a.py": ["1: imports dill", "2: imports marshal"],
        "spectrax_core/b.py": ["1: calls eval", "2: calls exec"],
        "spectrax_mpmd/_checkpoint/extra.py": ["2: calls np.load with allow_pickle"],
        "spectrax_mpmd/_comm/wire.py": ["1: imports pickle.loads"],
        "spectrax_mpmd/_planner/cache.py": ["1: imports pickle"],
        "spectrax_eager/c.py": ["2: reaches pickle by name"],
        "spectrax_eager/d.py": [f"1: reaches {EXECUTABLE_UNPICKLER}._JaxPjrtUnpickler by name"],
        "spectrax_eager/e.py": ["1: imports jax.experimental.serialize_executable"],
    }


def test_a_planted_exempt_module_that_reads_a_file_is_found(tmp_path):
    _plant(tmp_path, {"relocate.py": "import io\n\ndef load(p):\n    return io.BytesIO(open(p).read())\n"})
    assert readers(tmp_path / "relocate.py") == ["4: open"]
    _plant(tmp_path, {"relocate.py": "import numpy as np\n\ndef load(p):\n    return np.load(p)\n"})
    assert readers(tmp_path / "relocate.py") == ["4: load"]


def test_nothing_the_packages_read_back_can_run_code():
    found = code_loaders(ROOT)
    unexpected = {path: lines for path, lines in found.items() if path not in EXEMPT}
    assert not unexpected, "read data as JSON or arrays instead:\n" + "\n".join(
        f"{path}:{line}" for path, lines in unexpected.items() for line in lines
    )
    assert sorted(found) == sorted(EXEMPT), "an exemption no longer applies: remove it from EXEMPT"


def test_the_exempt_modules_read_nothing_from_files_or_other_processes():
    for path in EXEMPT:
        assert readers(ROOT / path) == [], f"{path} is exempt only while it reads nothing from outside"
