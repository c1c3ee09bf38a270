"""Run every program here on the seed library and keep what it prints as `<program>.json`.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 /path/to/seed-venv/bin/python record.py [name ...]

The interpreter must have `spectrax-lib` installed (imported as `spectrax`); the programs are
run as written, from a directory outside any package, and the last line each prints (a JSON
object) is stored next to it. `tests/eager/test_seed_programs.py` runs the same programs with
the import changed to this project's and compares.
"""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def programs() -> list[Path]:
    return sorted(p for p in HERE.glob("*.py") if p.name != "record.py" and not p.name.startswith("_"))


def main(names: list[str]) -> None:
    for path in programs():
        if names and path.stem not in names:
            continue
        run = subprocess.run(
            [sys.executable, str(path)], capture_output=True, text=True, cwd="/", check=False
        )
        if run.returncode != 0:
            print(f"{path.stem}: failed\n{run.stderr[-2000:]}")
            continue
        out = json.loads(run.stdout.strip().splitlines()[-1])
        path.with_suffix(".json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"{path.stem}: recorded")


if __name__ == "__main__":
    main(sys.argv[1:])
