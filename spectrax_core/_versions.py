"""The JAX versions SpectraX supports, checked once when `spectrax_core` is imported.

The MPMD compiler reads JAX's jaxprs and a few of its internals, which change
between releases: an older JAX than the oldest tested one fails somewhere deep
inside a module, so it is refused up front with one clear error instead. A
newer JAX than the newest tested one usually works (every private name has a
public fallback), so it only gets a warning.
"""

from __future__ import annotations

import re
import warnings

# the oldest versions SpectraX is tested on: pyproject.toml's lower bounds, which CI's second step
# installs exactly (`.ci/oldest`)
OLDEST = {"jax": "0.10.0", "jaxlib": "0.10.0"}
# the newest (major, minor) of JAX the whole suite has run on
NEWEST_TESTED = (0, 10)


class UntestedJaxWarning(UserWarning):
    """JAX is newer than the newest release SpectraX was tested on."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: `"0.10.2.dev20260101"` -> `(0, 10, 2)`."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(part) for part in match.group().split("."))


def installed() -> dict[str, str]:
    """The installed JAX and jaxlib versions."""
    import jax
    import jaxlib.version

    return {"jax": jax.__version__, "jaxlib": jaxlib.version.__version__}


def check(versions: dict[str, str] | None = None) -> None:
    """Raise ImportError if JAX or jaxlib is older than supported; warn if JAX is newer than tested."""
    versions = installed() if versions is None else versions
    old = {name: v for name, v in versions.items() if release(v) < release(OLDEST[name])}
    if old:
        have = ", ".join(f"{name} {v}" for name, v in old.items())
        need = ", ".join(f"{name}>={OLDEST[name]}" for name in old)
        pins = " ".join(f'"{name}>={OLDEST[name]}"' for name in OLDEST)
        raise ImportError(
            f"SpectraX needs {need}; installed: {have}. Upgrade with: pip install --upgrade {pins}"
        )
    if release(versions["jax"])[:2] > NEWEST_TESTED:
        major, minor = NEWEST_TESTED
        warnings.warn(
            f"jax {versions['jax']} is newer than the newest release SpectraX is tested on "
            f"({major}.{minor}.x); if something fails, "
            f'pip install "jax<{major}.{minor + 1}" "jaxlib<{major}.{minor + 1}" is known to work.',
            UntestedJaxWarning,
            stacklevel=2,
        )


check()
