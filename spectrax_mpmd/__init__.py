"""spectrax_mpmd: true MPMD pipeline parallelism — one compiled program per pipeline rank.

Imports `spectrax_core`; never `spectrax_eager`.
"""

from ._api import sxgrad, sxjit, sxvalue_and_grad
from ._marker import sxstage_iter
from ._mesh import MpmdMesh, create_mesh
from ._optim import StagedOptimizer, StagedOptState
from .errors import MarkerError, MeshError, MpmdError, StageSplitError, TraceContextError

__all__ = [
    "create_mesh",
    "MpmdMesh",
    "sxstage_iter",
    "sxjit",
    "sxvalue_and_grad",
    "sxgrad",
    "StagedOptimizer",
    "StagedOptState",
    "MpmdError",
    "MeshError",
    "MarkerError",
    "StageSplitError",
    "TraceContextError",
]
