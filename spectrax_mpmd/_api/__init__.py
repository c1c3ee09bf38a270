"""The public entry points: `sxjit`, `sxvalue_and_grad`, `sxgrad`, `sxvalue_and_grad_and_apply`,
`profile_stages`."""

from .apply import sxvalue_and_grad_and_apply
from .grad import profile_stages, step_function, sxgrad, sxvalue_and_grad
from .jit import sxjit
from .treduce import Add, Concat, Max, Mean, Reduction, treduce

__all__ = [
    "Add",
    "Concat",
    "Max",
    "Mean",
    "Reduction",
    "treduce",
    "profile_stages",
    "step_function",
    "sxgrad",
    "sxjit",
    "sxvalue_and_grad",
    "sxvalue_and_grad_and_apply",
]
