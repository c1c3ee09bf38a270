"""Prove a loss exact under microbatching, or say which operation stops the proof.

`prove` tags the loss's microbatch trace against its whole-batch trace
(`loss_form`, `loss_rules`), and for a loss affine in sums over rows returns the
stage programs' jaxpr (the loss output replaced by the packed partial sums and
terms) and the `LossHead` the loss cell evaluates (`loss_head`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..errors import MpmdError
from .jax_private import ClosedJaxpr, Literal, Var, source_info_util
from .jaxpr import needed_eqns, producers, resolve
from .loss_form import COEF, INV, LIN, ROW, SUM, TERM, TOP, Analysis, StructureError, Val
from .loss_head import LossHead, body_with_packed_loss, head_of, widest
from .loss_rules import rule
from .pruned import PER_OPERAND

PARAM, BATCH, OTHER = 1, 2, 4  # the kinds of a flat argument leaf
PLAIN_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
WAYS_OUT = (
    "Ways out: compute the loss as sums over the batch scaled by values of the batch alone (a token "
    "mean sum(ce * mask) / max(sum(mask), 1), jnp.mean, a sum of such terms, parameter regularisers); "
    "pass microbatch_weight_fn=w (the step returns sum(w_i * loss_i) / sum(w_i), w_i from microbatch "
    "i's arguments); or pass reduce='mean' (or 'sum') to accept the mean (or sum) of the microbatch "
    "losses."
)


class NotExact(MpmdError):
    """The loss is not provably the whole batch's loss when computed per microbatch."""


def flatten(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, dict]:
    """`closed` with its plain calls (`jax.jit` helpers) inlined, each inlined equation under its
    full scope (its calls' name stacks: the stage region it was traced in); and for each inlined
    equation the top-level call it came from (`id(eqn) -> call`: where the user's source line is)."""
    out, origin, consts = [], {}, {}

    def walk(eqns, mapping: dict, stack, call) -> None:
        for eqn in eqns:
            invars = [v if isinstance(v, Literal) else mapping.get(v, v) for v in eqn.invars]
            scope = eqn.source_info.name_stack if stack is None else stack + eqn.source_info.name_stack
            if eqn.primitive.name in PLAIN_CALLS:
                body = eqn.params["jaxpr"]
                inner = dict(zip(body.jaxpr.invars, invars))
                for cv, value in zip(body.jaxpr.constvars, body.consts):
                    inner[cv] = fresh = Var(cv.aval)
                    consts[fresh] = value
                walk(body.jaxpr.eqns, inner, scope, call or eqn)
                mapping.update((o, resolve(r, inner)) for o, r in zip(eqn.outvars, body.jaxpr.outvars))
            elif stack is None:
                out.append(eqn.replace(invars=invars))
            else:
                outvars = []
                for v in eqn.outvars:
                    outvars.append(mapping.setdefault(v, Var(v.aval)) if isinstance(v, Var) else v)
                new = eqn.replace(
                    invars=invars, outvars=outvars, source_info=eqn.source_info.replace(name_stack=scope)
                )
                origin[id(new)] = call
                out.append(new)

    top: dict = {}
    walk(closed.jaxpr.eqns, top, None, None)
    jaxpr = closed.jaxpr.replace(
        eqns=out,
        outvars=[resolve(v, top) for v in closed.jaxpr.outvars],
        constvars=[*closed.jaxpr.constvars, *consts],
    )
    return ClosedJaxpr(jaxpr, [*closed.consts, *consts.values()]), origin


def where(eqn, origin: dict) -> str:
    """The user's source line of `eqn` (that of the `jax.jit` call it was inlined from, if any)."""
    return source_info_util.summarize(origin.get(id(eqn), eqn).source_info)


def _refuse(name: str, what: str) -> NotExact:
    return NotExact(
        f"{name}: the loss cannot be proven equal to the whole batch's when computed per "
        f"microbatch: {what}. {WAYS_OUT}"
    )


def _inputs(jm, jw, kinds: dict, keys: frozenset) -> list[Val]:
    tags = []
    for a, (vm, vw) in enumerate(zip(jm.invars, jw.invars)):
        kind = kinds.get(a, OTHER)
        rows = vm.aval.shape != vw.aval.shape
        tags.append(Val(INV, True) if kind == PARAM else Val(ROW if rows else INV, folded=a in keys))
    return tags


def _head_inputs(eqn, an: Analysis) -> list:
    """The variables a head equation reads: every input, or for a per-operand identity (a stage
    marker carrying a term between stages) the inputs of its row-free linear outputs."""
    pairs = (
        zip(eqn.invars, eqn.outvars) if eqn.primitive.name in PER_OPERAND else ((v, None) for v in eqn.invars)
    )
    return [
        v
        for v, out in pairs
        if isinstance(v, Var)
        and not isinstance(v, Literal)
        and (out is None or an.env[out].tag in (LIN, TERM))
    ]


def _adds_a_constant(eqn, an: Analysis) -> bool:
    """Whether a head equation may add a constant to the sums (an addend, a padding value or a
    branch that is not itself linear in them)."""
    name = eqn.primitive.name
    if name in ("cond", "pad"):
        return True
    if name not in ("add", "sub", "add_any", "concatenate", "select_n"):
        return False
    operands = eqn.invars[1:] if name == "select_n" else eqn.invars
    return any(
        bool(np.any(v.val))
        if isinstance(v, Literal)
        else an.env[v].tag not in (SUM, LIN) and not an.env[v].zero
        for v in operands
    )


def prove(
    name: str, micro: ClosedJaxpr, whole: ClosedJaxpr, kinds: dict, m: int, keys: frozenset
) -> tuple[ClosedJaxpr, LossHead]:
    """`(stage programs' jaxpr, LossHead)` for the loss traced on a microbatch (`micro`) and on the
    whole batch (`whole`), `m` microbatches, `keys` the PRNG key arguments (folded per
    microbatch); raises `NotExact` naming what stops the proof."""
    (fm, origin), (fw, _) = flatten(micro), flatten(whole)
    jm, jw = fm.jaxpr, fw.jaxpr
    an = Analysis(m, rule)
    try:
        an.run(jm, jw, _inputs(jm, jw, kinds, keys), (fm.consts, fw.consts))
    except StructureError as e:
        raise _refuse(
            name,
            f"it traces to different programs on a microbatch and on the whole batch ({e}; "
            "Python control flow on the batch's shape?)",
        ) from None
    loss = jm.outvars[0]
    if isinstance(loss, Literal):
        raise _refuse(name, "it is a constant")
    cone = sorted(needed_eqns(jm.eqns, [loss]))
    tag = an.env[loss]
    if tag.tag == TOP:
        blocked = [k for k in cone if k in an.blockers]
        if blocked:
            b = an.blockers[blocked[0]]
            place = where(b.eqn, origin) or where(jm.eqns[blocked[0]], origin)  # a loop body's: its loop's
            raise _refuse(name, f"`{b.eqn.primitive.name}` at {place} {b.reason}")
        raise _refuse(name, "it depends on the batch in a way the analysis cannot follow")
    linear = (LIN, TERM)
    head = [k for k in cone if any(an.env.get(v, Val(INV)).tag in linear for v in jm.eqns[k].outvars)]
    reads = []
    for k in head:
        eqn = jm.eqns[k]
        ins = _head_inputs(eqn, an)
        if any(an.rows(v) for v in ins):
            raise _refuse(
                name,
                f"`{eqn.primitive.name}` at {where(eqn, origin)} computes a scaling by a quantity of "
                "the batch together with per-row values; reduce the rows first, then scale",
            )
        reads += ins
    made = {v for k in head for v in jm.eqns[k].outvars}
    if loss not in made:
        reads.append(loss)
    sources, terms, coefs = [], [], []
    for v in dict.fromkeys(reads):
        if v in made:
            continue
        t = an.env[v]
        group = sources if t.tag == SUM else terms if t.params else coefs
        if t.params and t.tag not in (SUM, INV) or not t.params and t.tag not in (INV, COEF):
            raise _refuse(name, f"a value of kind {t.tag!r} reaches the loss after the sum over the batch")
        if t.params and not jnp.issubdtype(v.aval.dtype, jnp.floating):
            raise _refuse(
                name, f"an integer value {v.aval.str_short()} that depends on the parameters reaches the loss"
            )
        group.append(v)
    if not sources and not terms:
        raise _refuse(name, "it does not depend on the differentiated arguments")
    wide = widest([v.aval.dtype for v in (*sources, *terms)] + [loss.aval.dtype])
    made_by = producers(jm.eqns)
    like = jm.eqns[made_by[loss]] if loss in made_by else (jm.eqns[-1] if jm.eqns else None)
    body = body_with_packed_loss(fm, [*sources, *terms], wide, like)
    w = an.whole_of
    result = head_of(
        fw,
        head,
        [w[v] for v in sources],
        [w[v] for v in terms],
        [w[v] for v in coefs],
        w.get(loss, loss),
        wide,
        bool(terms) or any(_adds_a_constant(jm.eqns[k], an) for k in head),
    )
    if any(kinds.get(a) == PARAM for a in result.reads):
        raise _refuse(name, "a coefficient of the loss reads the parameters on the whole batch")
    return body, result
