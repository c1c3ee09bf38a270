"""spectrax_mpmd: true MPMD pipeline parallelism — one compiled program per pipeline rank.

Imports `spectrax_core`; never `spectrax_eager`.
"""

import spectrax_core  # noqa: F401 - imported first: it refuses an unsupported JAX before any module reads it

from ._api import (
    Add,
    Concat,
    Max,
    Mean,
    Reduction,
    profile_stages,
    sxgrad,
    sxjit,
    sxvalue_and_grad,
    sxvalue_and_grad_and_apply,
    treduce,
)
from ._buckets import LengthBuckets
from ._checkpoint.layout import CheckpointError
from ._checkpoint.manager import (
    CheckpointManager,
    Restored,
    owner_shardings,
    restore_checkpoint,
    save_checkpoint,
)
from ._checkpoint.owners import init_on_owners, owner_layout
from ._comm import Exchange, initialize
from ._facade.decode import PipelineDecoder
from ._facade.gather import gather
from ._facade.generate.split import DecodeSplit, decode_split
from ._facade.parity import Parity, check_parity
from ._facade.run import run, runner, sxcall
from ._facade.runner import Runner, call_with, pipeline_stages, train_loss
from ._facade.step_decode import StepDecoder
from ._mesh import MpmdMesh, create_mesh, create_rank_mesh, mesh_of_ranks
from ._optim import StagedOptimizer, StagedOptState
from ._planner.advise import Advice, Candidate, advise
from ._planner.balance import Balance, auto_balance, balance, split_blocks
from ._planner.device_advice import DeviceBalance
from ._runtime import CellProfile, HostProfile, HostRow, StageProfile
from ._settings import StepSettings
from ._stages import StagedStack, stage_blocks, stage_sizes, unstage_blocks
from ._trace.marker import sxstage_iter
from ._trace.policy import Offload
from ._trace.region import regions_in, sxstage_region
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
    "LengthBuckets",
    "run",
    "PipelineDecoder",
    "StepDecoder",
    "decode_split",
    "DecodeSplit",
    "runner",
    "pipeline_stages",
    "call_with",
    "train_loss",
    "Runner",
    "StepSettings",
    "sxcall",
    "gather",
    "check_parity",
    "Parity",
    "StagedStack",
    "stage_blocks",
    "unstage_blocks",
    "stage_sizes",
    "create_mesh",
    "create_rank_mesh",
    "mesh_of_ranks",
    "MpmdMesh",
    "sxstage_iter",
    "sxstage_region",
    "regions_in",
    "sxjit",
    "sxvalue_and_grad",
    "sxgrad",
    "sxvalue_and_grad_and_apply",
    "treduce",
    "Reduction",
    "Add",
    "Mean",
    "Max",
    "Concat",
    "StagedOptimizer",
    "StagedOptState",
    "HostProfile",
    "HostRow",
    "profile_stages",
    "Offload",
    "advise",
    "balance",
    "auto_balance",
    "Balance",
    "DeviceBalance",
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
    "Exchange",
    "CheckpointManager",
    "CheckpointError",
    "Restored",
    "save_checkpoint",
    "restore_checkpoint",
    "owner_shardings",
    "init_on_owners",
    "owner_layout",
]
