"""`spectrax_eager.transforms.scan`: `spectrax-lib`'s module path `spectrax.transforms.scan`, holding
the transforms (`spx`'s)."""

from .._transforms.loops import associative_scan, scan

__all__ = ["associative_scan", "scan"]
