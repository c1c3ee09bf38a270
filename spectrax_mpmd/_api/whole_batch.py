"""The function traced once on the whole batch, on first need.

Two things read the function at the whole batch's shapes: a call without
`schedule=` learns from the regions it opens how many microbatches to split into,
and a loss scaled by batch statistics has its factors evaluated on the whole batch
(`spectrax_mpmd._trace.weights`). Both read the same trace, made at most once per
signature.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .._compile.stats import BuildStats
from .._trace.args import Signature, traced_avals
from .._trace.split import trace


class WholeBatchTrace:
    """`fn` (a function of the signature's leaves' pytree) traced on the whole batch when
    first read: `closed` its jaxpr, `regions` the `sxstage_region`s it opened."""

    def __init__(self, fn: Callable, sig: Signature, stats: BuildStats):
        self._fn, self._sig, self._stats = fn, sig, stats

    @functools.cached_property
    def _traced(self) -> tuple:
        with self._stats.timed("trace"):
            whole = self._sig.in_tree.unflatten(traced_avals(self._sig, None, 1))
            closed, _, _, regions = trace(self._fn, whole)
        return closed, regions

    @property
    def closed(self):
        return self._traced[0]

    @property
    def regions(self) -> dict:
        return self._traced[1]
