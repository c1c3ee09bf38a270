"""`spectrax_eager.nn.pipeline_sequential`: `spectrax-lib`'s module path
`spectrax.nn.pipeline_sequential`, holding layers (`spx.nn`'s)."""

from ._containers import PipelineSequential

__all__ = ["PipelineSequential"]
