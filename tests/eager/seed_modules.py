"""The seed library's module paths and the public names each holds, recorded in
`data/seed_modules.tsv` as `module<TAB>name<TAB>home`: `home` is the module of the seed's
documented interface (`spectrax`, `spectrax.nn`, ... the modules docs/migrating.md tables) that
exports the same object, `-` when none does. A module's names are its `__all__`, else the public
names it defines. `python seed_modules.py` with the seed library installed (imported as
`spectrax`) writes the file; `test_seed_modules.py` checks the paths here against it."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

DATA = Path(__file__).parent / "data" / "seed_modules.tsv"
#: The seed's modules of its documented interface, searched in this order for a name's home.
HOMES = (
    "spectrax",
    "spectrax.nn",
    "spectrax.sharding",
    "spectrax.init",
    "spectrax.functional",
    "spectrax.inspect",
    "spectrax.hooks",
    "spectrax.runtime",
)


def public_names(module) -> list[str]:
    """`__all__`, else the public names `module` defines (not the ones it imports)."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n
            for n, v in vars(module).items()
            if not inspect.ismodule(v) and getattr(v, "__module__", None) == module.__name__
        ]
    return sorted(n for n in names if not n.startswith("_"))


def record(top: str = "spectrax") -> list[tuple[str, str, str]]:
    """`(module, name, home)` of every public name of every public module of `top`."""
    package = importlib.import_module(top)
    found = [top] + sorted(m.name for m in pkgutil.walk_packages(package.__path__, f"{top}."))
    homes = {h: vars(importlib.import_module(h)) for h in HOMES}
    rows = []
    for name in found:
        if any(part.startswith("_") for part in name.split(".")):
            continue
        module = importlib.import_module(name)
        for n in public_names(module):
            obj = getattr(module, n)
            home = next((h for h in HOMES if h != name and n in homes[h] and homes[h][n] is obj), "-")
            rows.append((name, n, home))
    return rows


def recorded() -> list[tuple[str, str, str]]:
    """The recorded `(module, name, home)` rows."""
    return [tuple(line.split("\t")) for line in DATA.read_text().splitlines()]


if __name__ == "__main__":
    DATA.write_text(
        "".join(f"{m}\t{n}\t{h}\n" for m, n, h in record(sys.argv[1] if len(sys.argv) > 1 else "spectrax"))
    )
