"""`spectrax_eager.inspect.counting`: `spectrax-lib`'s module path `spectrax.inspect.counting`, holding
inspection helpers (`spx.inspect`'s)."""

from . import count_bytes, count_parameters, format_parameters

__all__ = ["count_bytes", "count_parameters", "format_parameters"]
