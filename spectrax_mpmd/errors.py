"""Error types of the MPMD runtime: each says what was given, what was expected, what to do."""


class MpmdError(ValueError):
    """Base class of every error `spectrax_mpmd` raises for bad input."""


class StageSplitError(MpmdError):
    """The traced function cannot be cut into the pipeline stages the mesh and schedule need."""


class MeshError(MpmdError):
    """The mesh does not have the axis or shape the call needs."""


class TraceContextError(MpmdError):
    """An MPMD entry point was called inside an outer JAX transformation."""


class MarkerError(MpmdError, TypeError):
    """A stage marker (`sxstage_iter`) was given arguments it cannot use."""


class DistributedError(MpmdError):
    """A multi-process run is set up wrongly (world size, process ids, coordinator, mesh layout)."""


class TransferTimeoutError(DistributedError, TimeoutError):
    """A cross-process transfer did not arrive within the configured timeout."""


class PeerLostError(DistributedError):
    """A cross-process transfer failed because the process sending it is gone."""
