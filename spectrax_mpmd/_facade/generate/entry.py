"""Generation as a run's entry point: `runner(...).generate` and `run(..., mode="generate")`.

A `Generation` holds one run configuration (mesh, schedule, stage sizes). On a
mesh with a pipeline axis it keeps one `PipelineDecoder` per model structure
and hands it each call's parameters (`PipelineDecoder.update`): the arrays a
pipelined training step left on their ranks are used there, and a later
optimizer step's values reuse the compiled programs. On a mesh without one it
is the unsplit `spectrax_core.models.generate` over the parameters where the
SPMD step left them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax

from spectrax_core.models import generate

from ..._settings import StepSettings
from ..._stages import stage_blocks
from ..._trace.context import methods_outside_context_mesh
from ...errors import MpmdError
from ..decode import PipelineDecoder
from .stages import same_model

OPTIONS = ("groups", "lengths", "sampler", "keys", "stop_tokens", "pad_id", "max_len", "record")


def check_options(options: dict, name: str) -> None:
    """Raise naming any keyword that is not a generation option."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise MpmdError(
            f"{name}: unknown generation option(s) {unknown}; the options are {', '.join(OPTIONS)} "
            "(see PipelineDecoder.generate)."
        )


@methods_outside_context_mesh
class Generation:
    """`generation(model, prompt, max_new_tokens, **options)`: the new tokens, as `PipelineDecoder.generate`.

    `sizes()` gives the blocks per stage at call time (None: the model's own
    staging if it has the stage count, else an even split), so a runner whose
    split is chosen on its first training call generates with that split.
    """

    def __init__(self, mesh, schedule=None, sizes: Callable[[], Sequence[int] | None] = lambda: None):
        self.mesh, self.schedule, self.sizes = mesh, schedule, sizes
        self.mpmd = StepSettings("run", mesh=mesh).pipelined
        self.decoder = None

    def decoder_for(self, model):
        """The decoder for `model`'s structure, holding `model`'s values (built on first use)."""
        sizes, old = self.sizes(), self.decoder
        if old is not None and same_model(old.lm, stage_blocks(model, len(old.lm.blocks.parts), sizes)):
            return old.update(model)
        self.decoder = PipelineDecoder(model, mesh=self.mesh, schedule=self.schedule, stage_sizes=sizes)
        return self.decoder

    def __call__(self, model, prompt, max_new_tokens, **options):
        check_options(options, "generate")
        if self.mpmd:
            return self.decoder_for(model).generate(prompt, max_new_tokens, **options)
        options.pop("groups", None)  # one program decodes the whole batch
        if options.pop("record", None) is not None:
            raise MpmdError("generate: record= measures a pipelined run; this mesh has no pipeline axis.")
        mesh = self.mesh.jax_mesh if hasattr(self.mesh, "jax_mesh") else self.mesh
        with jax.set_mesh(mesh):
            return generate(model, prompt, max_new_tokens, **options)
