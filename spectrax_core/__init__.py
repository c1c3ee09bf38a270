"""spectrax_core: pure functions and typed params pytrees.

Imports jax, optax, equinox and jaxtyping only; never `spectrax_mpmd` or
`spectrax_eager`. Importing it checks the JAX version (`_versions`).
"""

from . import (
    _versions,  # noqa: F401 - imported first: it refuses an unsupported JAX before any module reads it
    functional,
    init,
    losses,
    models,
    nn,
    schedules,
    sharding,
)
from ._apply import apply, register_apply
from ._checks import enable_runtime_checks, runtime_checks_enabled

__all__ = [
    "apply",
    "register_apply",
    "nn",
    "functional",
    "init",
    "losses",
    "models",
    "sharding",
    "schedules",
    "enable_runtime_checks",
    "runtime_checks_enabled",
]
