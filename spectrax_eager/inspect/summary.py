"""`spectrax_eager.inspect.summary`: `spectrax-lib`'s module path `spectrax.inspect.summary`, holding
inspection helpers (`spx.inspect`'s)."""

from . import summary

__all__ = ["summary"]
