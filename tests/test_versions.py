"""The supported JAX range: an older JAX is refused at import with one clear error, a newer untested
one gets a warning; the declared bounds, CI's oldest pins and the import check agree."""

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from spectrax_core import _versions

ROOT = Path(__file__).resolve().parents[1]
NEWEST = ".".join(map(str, _versions.NEWEST_TESTED))


def _older(version: str) -> str:
    """A release just below `version` (`0.7.0` -> `0.6.99`)."""
    major, minor, *_ = _versions.release(version)
    return f"{major}.{minor - 1}.99" if minor else f"{major - 1}.99.99"


def test_release_reads_the_numeric_part():
    assert _versions.release("0.10.2") == (0, 10, 2)
    assert _versions.release("0.7.0.dev20260101+cuda12") == (0, 7, 0)
    with pytest.raises(ValueError, match="not a version"):
        _versions.release("dev")


@pytest.mark.parametrize("name", ["jax", "jaxlib"])
def test_an_older_version_raises_one_clear_import_error(name):
    versions = dict(_versions.OLDEST)
    versions[name] = _older(_versions.OLDEST[name])
    with pytest.raises(ImportError) as info:
        _versions.check(versions)
    message = str(info.value)
    assert f"installed: {name} {versions[name]}." in message
    assert f"{name}>={_versions.OLDEST[name]}" in message
    assert "pip install --upgrade" in message


def test_supported_versions_pass_silently():
    oldest = dict(_versions.OLDEST)
    newest = {"jax": f"{NEWEST}.99", "jaxlib": f"{NEWEST}.99"}
    for versions in (oldest, newest, _versions.installed()):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _versions.check(versions)


def test_a_newer_untested_jax_warns_once_and_does_not_raise():
    major, minor = _versions.NEWEST_TESTED
    newer = {"jax": f"{major}.{minor + 1}.0", "jaxlib": f"{major}.{minor + 1}.0"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _versions.check(newer)
    assert [w.category for w in caught] == [_versions.UntestedJaxWarning]
    assert f"jax {major}.{minor + 1}.0" in str(caught[0].message) and f"{NEWEST}.x" in str(caught[0].message)


def _import_with_jax_version(
    module: str, version: str, action: str = "default"
) -> subprocess.CompletedProcess:
    """`import module` in a fresh interpreter whose JAX reports `version`, warnings filtered by `action`."""
    script = (
        "import jax, jaxlib.version\n"
        f"jax.__version__ = jaxlib.version.__version__ = {version!r}\n"
        f"import {module}\n"
    )
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    command = [sys.executable, "-W", action, "-c", script]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, check=False)


@pytest.mark.parametrize("module", ["spectrax_mpmd", "spectrax_eager"])
def test_importing_under_an_older_jax_ends_in_the_clear_error(module):
    old = _older(_versions.OLDEST["jax"])
    result = _import_with_jax_version(module, old)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ImportError: SpectraX needs jax>=")
        and f"installed: jax {old}, jaxlib {old}." in last
    ), last


def test_importing_every_package_under_a_newer_jax_warns_once():
    major, minor = _versions.NEWEST_TESTED
    newer = f"{major}.{minor + 1}.0"
    result = _import_with_jax_version("spectrax_core, spectrax_mpmd, spectrax_eager", newer, "always")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("UntestedJaxWarning") == 1, result.stderr[-3000:]
    assert f"jax {newer} is newer than the newest release SpectraX is tested on" in result.stderr


def test_the_declared_bounds_are_the_checked_ones_and_ci_pins_each_of_them():
    """pyproject's lower bounds of jax/jaxlib are `OLDEST`, and CI's second step pins every
    declared lower bound of the runtime and test dependencies exactly."""
    text = (ROOT / "pyproject.toml").read_text()
    declared = dict(re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][^",;]*)"', text))
    script = [sys.executable, str(ROOT / ".ci" / "oldest_pins.py")]
    out = subprocess.run(script, capture_output=True, text=True, check=True).stdout
    pins = dict(line.split("==") for line in out.split())
    for name, oldest in _versions.OLDEST.items():
        assert declared[name] == pins[name] == oldest, name
    runtime = ("jax", "jaxlib", "optax", "jaxtyping", "equinox", "beartype", "orbax-checkpoint", "pytest")
    for name in runtime:
        assert pins[name] == declared[name], name
