"""The base of params classes without arrays of their own (`Block`, `MLP`, `TransformerLM`, ...)."""

from __future__ import annotations

import equinox as eqx


class Composite(eqx.Module):
    """Params whose arrays all live in sub-modules, or that have none: `logical_axes` declares
    nothing, and `spectrax_core.sharding` recurses into the sub-modules, which declare theirs."""

    def logical_axes(self) -> dict[str, tuple]:
        """No array fields of its own; its sub-modules declare theirs."""
        return {}
