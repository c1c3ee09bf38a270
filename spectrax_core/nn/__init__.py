"""Functional layers: each a typed params class with `init`, run by `spectrax_core.apply`."""

from ._linear import Linear

__all__ = ["Linear"]
