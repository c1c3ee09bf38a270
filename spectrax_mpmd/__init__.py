"""spectrax_mpmd: true MPMD pipeline parallelism — one compiled program per pipeline rank.

Imports `spectrax_core`; never `spectrax_eager`.
"""

from ._advise import Advice, Candidate, advise
from ._api import profile_stages, sxgrad, sxjit, sxvalue_and_grad
from ._balance import Balance, balance, split_blocks
from ._checkpoint import CheckpointManager, Restored, owner_shardings, restore_checkpoint, save_checkpoint
from ._checkpoint_layout import CheckpointError
from ._decode import PipelineDecoder
from ._comm import initialize
from ._marker import sxstage_iter
from ._mesh import MpmdMesh, create_mesh
from ._optim import StagedOptimizer, StagedOptState
from ._profile import HostProfile, HostRow
from ._region import sxstage_region
from ._run import Runner, call_with, gather, pipeline_stages, run, runner, sxcall, train_loss
from ._stage_profile import CellProfile, StageProfile
from ._stages import StagedStack, stage_blocks, stage_sizes, unstage_blocks
from .errors import (
    DistributedError,
    MarkerError,
    MeshError,
    MpmdError,
    PeerLostError,
    StageSplitError,
    TraceContextError,
    TransferTimeoutError,
)

__all__ = [
    "run",
    "PipelineDecoder",
    "runner",
    "pipeline_stages",
    "call_with",
    "train_loss",
    "Runner",
    "sxcall",
    "gather",
    "StagedStack",
    "stage_blocks",
    "unstage_blocks",
    "stage_sizes",
    "create_mesh",
    "MpmdMesh",
    "sxstage_iter",
    "sxstage_region",
    "sxjit",
    "sxvalue_and_grad",
    "sxgrad",
    "StagedOptimizer",
    "StagedOptState",
    "HostProfile",
    "HostRow",
    "profile_stages",
    "advise",
    "balance",
    "Balance",
    "split_blocks",
    "Advice",
    "Candidate",
    "StageProfile",
    "CellProfile",
    "MpmdError",
    "MeshError",
    "MarkerError",
    "StageSplitError",
    "TraceContextError",
    "DistributedError",
    "TransferTimeoutError",
    "PeerLostError",
    "initialize",
    "CheckpointManager",
    "CheckpointError",
    "Restored",
    "save_checkpoint",
    "restore_checkpoint",
    "owner_shardings",
]
