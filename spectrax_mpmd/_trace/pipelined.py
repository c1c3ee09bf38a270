"""A pipelined step called inside `sxjit`: one equation of the traced training step.

While `sxjit` traces a function (`tracing_train_step`), calling a
`sxvalue_and_grad` step on traced arguments binds `sxpipeline_p` instead of
running: one equation whose outputs are the loss, the stacked auxiliary results
and the gradients, with the step's own traced and split loss held in its
parameters (`PipelineCall`). `sxjit` then builds one plan from it: the pipeline,
then every other equation of the function (the optimizer update, clipping,
metrics) split by ownership.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import MpmdError, TraceContextError
from .jax_private import ClosedJaxpr, Literal, Primitive
from .jaxpr import EVERY_CALL, contains_primitive, inline_calls, sub_jaxprs

_tracing: contextvars.ContextVar[object] = contextvars.ContextVar("spectrax_train_step", default=None)


@dataclass(frozen=True, eq=False)
class PipelineCall:
    """What a bound pipelined step is: the step, the signature of its call (over its own leaves)
    and its traced pipeline; its outputs are `[loss, *stacked aux, *grads]`."""

    step: object
    sig: object
    pipeline: object
    out_avals: tuple
    n_aux: int

    def __hash__(self) -> int:
        return id(self)


def _abstract(*avals, call: PipelineCall):
    return list(call.out_avals)


def _impl(*args, call: PipelineCall):
    raise TraceContextError(
        f"{call.step.name}: a pipelined step bound for sxjit was evaluated outside it; call the step "
        "from plain Python or inside an sxjit function."
    )


sxpipeline_p = Primitive("sxpipeline")
sxpipeline_p.multiple_results = True
sxpipeline_p.def_abstract_eval(_abstract)
sxpipeline_p.def_impl(_impl)


@contextlib.contextmanager
def tracing_train_step(function) -> Iterator[None]:
    """While `sxjit` (`function`) traces: pipelined steps called on traced values bind `sxpipeline_p`."""
    token = _tracing.set(function)
    try:
        yield
    finally:
        _tracing.reset(token)


def inside_train_step() -> bool:
    return _tracing.get() is not None


def traced_train_step():
    """The `sxjit` function being traced (its mesh and compiler), or None."""
    return _tracing.get()


@dataclass(frozen=True)
class FoundCall:
    """The pipelined step's equation in a traced function, after inlining calls."""

    eqns: list
    index: int  # of the pipelined equation in `eqns`
    consts: dict
    invars: tuple  # the function's
    outvars: list

    @property
    def call(self) -> PipelineCall:
        return self.eqns[self.index].params["call"]


def find_pipeline_call(closed: ClosedJaxpr, name: str) -> FoundCall | None:
    """The one `sxpipeline_p` equation of `closed` (calls inlined), or None; raises if there are
    several, one sits inside control flow, or one reads a computed value."""
    if not contains_primitive(closed.jaxpr, sxpipeline_p.name):
        return None
    eqns, mapping, consts, _ = inline_calls(closed.jaxpr, lambda e: e.primitive.name in EVERY_CALL)
    found = [k for k, e in enumerate(eqns) if e.primitive is sxpipeline_p]
    nested = [
        e
        for e in eqns
        if e.primitive is not sxpipeline_p
        and any(contains_primitive(j, sxpipeline_p.name) for j in sub_jaxprs(e))
    ]
    if nested or len(found) != 1:
        raise MpmdError(
            f"{name}: the function calls a pipelined step {len(found)} time(s)"
            f"{' inside control flow' if nested else ''}; an sxjit training step calls one "
            "sxvalue_and_grad step (one schedule) once, outside lax.cond/scan/while."
        )
    invars = set(closed.jaxpr.invars)
    for v in eqns[found[0]].invars:
        if isinstance(v, Literal) or v not in invars:
            raise MpmdError(
                f"{name}: the pipelined step reads a value computed inside the function; pass it the "
                "function's own arguments (parameters, batch) and compute derived inputs before the call "
                "or inside the loss."
            )
    outvars = [v if isinstance(v, Literal) else mapping.get(v, v) for v in closed.jaxpr.outvars]
    return FoundCall(eqns, found[0], consts, tuple(closed.jaxpr.invars), outvars)
