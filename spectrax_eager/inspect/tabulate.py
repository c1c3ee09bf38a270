"""`spectrax_eager.inspect.tabulate`: `spectrax-lib`'s module path `spectrax.inspect.tabulate`, holding
inspection helpers (`spx.inspect`'s)."""

from . import count_bytes, count_parameters, hlo_cost, tabulate

__all__ = ["count_bytes", "count_parameters", "hlo_cost", "tabulate"]
