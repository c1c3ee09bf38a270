"""The public namespaces: every name they have offered stays, and each addition is listed here.

A name leaving `__all__` (or one appearing without being listed as an addition) fails, so the
public surface changes only on purpose.
"""

import pytest

import spectrax_core.schedules
import spectrax_mpmd

MPMD = {
    "run", "PipelineDecoder", "runner", "pipeline_stages", "call_with", "train_loss", "Runner", "sxcall",
    "gather", "StagedStack", "stage_blocks", "unstage_blocks", "stage_sizes", "create_mesh", "MpmdMesh",
    "sxstage_iter", "sxstage_region", "sxjit", "sxvalue_and_grad", "sxgrad", "StagedOptimizer",
    "StagedOptState", "HostProfile", "HostRow", "profile_stages", "advise", "balance", "Balance",
    "split_blocks", "Advice", "Candidate", "StageProfile", "CellProfile", "MpmdError", "MeshError",
    "MarkerError", "StageSplitError", "TraceContextError", "DistributedError", "TransferTimeoutError",
    "PeerLostError", "initialize", "CheckpointManager", "CheckpointError", "Restored", "save_checkpoint",
    "restore_checkpoint", "owner_shardings",
}  # fmt: skip
MPMD_ADDED = {
    "decode_split",
    "DecodeSplit",
    "sxvalue_and_grad_and_apply",
    "treduce",
    "Reduction",
    "Add",
    "Mean",
    "Max",
    "Concat",
    "Offload",
    "init_on_owners",
    "owner_layout",
    "StepDecoder",
    "create_rank_mesh",
    "mesh_of_ranks",
    "DeviceBalance",
    "check_parity",
    "Parity",
    "regions_in",
    "Exchange",
    "StepSettings",
    "auto_balance",
    "LengthBuckets",
}

SCHEDULES = {
    "GPipe", "Std1F1B", "Eager1F1B", "ZeroBubbleH1", "InterleavedH1", "InterleavedGPipe",
    "Interleaved1F1BPlusOne", "DualPipeV", "KimiK2", "ALL_SCHEDULES", "Schedule", "Region",
    "RegionSchedule", "region_labels", "Action", "FusedAction", "ScheduleError", "Cost", "StageCost",
    "StageMemory", "peak_bytes", "Event", "Timeline", "simulate", "validate", "check_table", "render_grid",
    "chrome_trace", "save_chrome_trace",
}  # fmt: skip
SCHEDULES_ADDED = {
    "Flow", "Dependency", "Stuck", "DeadlockError", "issue_order", "parse_cell", "parse_table", "format_table",
    "ZeroBubbleH2", "ZBV", "VHalf", "VMin", "DualPipe", "MORE_SCHEDULES", "UserSchedule", "SearchedSchedule",
    "search", "UpdatedStep", "with_update",
    "BudgetError",
    "VALIDATIONS",
    "format_torch_csv", "parse_torch_csv", "read_torch_csv",
}  # fmt: skip


@pytest.mark.parametrize(
    "module, kept, added",
    [(spectrax_mpmd, MPMD, MPMD_ADDED), (spectrax_core.schedules, SCHEDULES, SCHEDULES_ADDED)],
    ids=["spectrax_mpmd", "spectrax_core.schedules"],
)
def test_public_names_are_kept_and_additions_listed(module, kept, added):
    names = set(module.__all__)
    assert len(names) == len(module.__all__), "a name is listed twice in __all__"
    assert not kept - names, f"names removed from {module.__name__}: {sorted(kept - names)}"
    assert names == kept | added, f"unlisted additions: {sorted(names - kept - added)}"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{module.__name__}.__all__ names what it does not define: {missing}"
