"""The public entry points: `sxjit`, `sxvalue_and_grad`, `sxgrad`, `profile_stages`."""

from .checks import check_mesh, check_schedule
from .grad import profile_stages, step_function, sxgrad, sxvalue_and_grad
from .jit import sxjit

__all__ = [
    "check_mesh",
    "check_schedule",
    "profile_stages",
    "step_function",
    "sxgrad",
    "sxjit",
    "sxvalue_and_grad",
]
