"""Print pip constraints pinning every lower bound pyproject.toml declares for the runtime and test
dependencies (`name>=X` -> `name==X`): the oldest versions CI installs for its second step."""

import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
requirements = [*project["dependencies"], *extras["test"], *extras["checkpoint"]]
for requirement in dict.fromkeys(requirements):
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([^,;\s]+)", requirement.replace(" ", ""))
    if match is None:
        sys.exit(f"no plain lower bound to pin in {requirement!r}")
    print(f"{match.group(1)}=={match.group(2)}")
