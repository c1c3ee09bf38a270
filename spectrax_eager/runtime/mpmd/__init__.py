"""`spx.runtime.mpmd`: `spectrax-lib`'s module path for the MPMD entry points (`spx`'s) and its
marker helpers (`markers`); `sxstage_iter` is `spectrax_mpmd`'s, imported on first use."""

from typing import Any

from ..._compat.paths import not_built
from ..._pipeline.entry_points import (
    sxgrad,
    sxjit,
    sxstage_region,
    sxvalue_and_grad,
    sxvalue_and_grad_and_apply,
)
from ..._pipeline.mpmd import mpmd_name
from ..._pipeline.regions import StageRegionSpec, stage_region_specs
from ..._pipeline.sxcall import sxcall

NOT_KEPT = (
    "spectrax-lib's MPMD compiler internals are not kept; pipelines compile through sxjit, "
    "sxvalue_and_grad, sxcall and spx.run (spectrax_mpmd.treduce reduces over microbatches), and "
    "loops inside a stage are jax.lax loops"
)


def __getattr__(name: str) -> Any:
    if name == "sxstage_iter":  # the MPMD runtime's, imported on first use
        return mpmd_name(name)
    return not_built(__name__, NOT_KEPT)(name)


__all__ = [
    "StageRegionSpec",
    "stage_region_specs",
    "sxcall",
    "sxgrad",
    "sxjit",
    "sxstage_iter",  # noqa: F822 (module __getattr__)
    "sxstage_region",
    "sxvalue_and_grad",
    "sxvalue_and_grad_and_apply",
]
