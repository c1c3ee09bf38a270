"""The per-primitive rules of the loss analysis (`spectrax_mpmd._trace.loss_form`).

A rule sees one equation of the microbatch trace, its whole-batch twin and its
inputs' tags, and returns its outputs' tags. Operations on row-free values
follow the algebra of sums and coefficients; operations on rows must keep each
row's values computed from that row alone (the batch axis is never reduced
except by a sum, never reordered, sliced or mixed with a whole-batch value).
An operation without a rule is `TOP` as soon as it touches rows or a sum.
"""

from __future__ import annotations

import jax.numpy as jnp

from .jax_private import JaxprEqn
from .jaxpr import EVERY_CALL as CALLS
from .loss_form import (
    ADDITIVE,
    AXIS_PARAMS,
    COEF,
    ELEMENTWISE,
    IDENTITY,
    INV,
    LIN,
    LINEAR_UNARY,
    MIX,
    RANDOM,
    ROW,
    ROW_FREE_LINEAR,
    SUM,
    TERM,
    TOP,
    Analysis,
    StructureError,
    Val,
    call_body,
    prefix_size,
    val,
)

CONSTANT_KEY = (
    "draws values for the batch's rows from a PRNG key that is a constant of the function (closed "
    "over or made inside it): every microbatch would draw the same values, where the whole batch "
    "draws different ones for each row. Pass the key as an argument instead: each microbatch then "
    "draws with `jax.random.fold_in(key, i)`"
)


def rule(an: Analysis, em: JaxprEqn, ew: JaxprEqn, ins: list[Val]) -> list[Val]:
    name = em.primitive.name
    if not em.outvars:  # an effect only (a debug callback): nothing flows on
        return []
    if name in CALLS:
        return _call(an, em, ew, ins)
    if name == "cond":
        return _cond(an, em, ew, ins)
    if name in ("scan", "while"):
        return _loop(an, em, ew, ins)
    if name in IDENTITY and len(em.invars) == len(em.outvars) > 1:
        return list(ins)
    params = any(v.params for v in ins)
    rows_in = [an.rows(v) for v in em.invars]
    rows_out = [an.rows(v) for v in em.outvars]
    if not any(rows_in) and not any(rows_out):
        return [_row_free(an, em, ins, params)] * len(em.outvars)
    if any(a is None for a in map(an.axes, [*em.invars, *em.outvars])):
        return [an.block(em, params, f"`{name}` makes an axis whose size is not the batch's over m")] * len(
            em.outvars
        )
    return [_rows(an, em, ins, rows_in, params)] * len(em.outvars)


# -- row-free values ------------------------------------------------------------------------


def _generic(ins: list[Val], params: bool) -> Val:
    """Any function of row-free values without sums: invariant, a coefficient, or a term."""
    if all(v.tag == INV for v in ins):
        return Val(INV, params)
    return val(TERM, params)


def _narrows(em: JaxprEqn) -> bool:
    src, dst = em.invars[0].aval.dtype, em.outvars[0].aval.dtype
    floats = jnp.issubdtype(src, jnp.floating) and jnp.issubdtype(dst, jnp.floating)
    return floats and jnp.dtype(dst).itemsize < max(jnp.dtype(src).itemsize, 4)


def _scaled(an, em, linear: Val, other: Val) -> Val:
    """A sum or linear value times (or over) `other`."""
    if other.tag == INV and not other.params:
        return linear
    if other.tag == COEF:
        return Val(LIN, True)
    return an.block(
        em, True, "multiplies a sum over the batch by a value that depends on the parameters", False
    )


def _row_free(an: Analysis, em: JaxprEqn, ins: list[Val], params: bool) -> Val:
    name = em.primitive.name
    linear = [v for v in ins if v.tag in ROW_FREE_LINEAR]
    if not linear:
        if name in LINEAR_UNARY:
            return ins[0] if ins else Val(INV)
        return _generic(ins, params)
    if name in LINEAR_UNARY:
        if name == "convert_element_type" and _narrows(em):
            return Val(LIN, True)  # a cast after the sum: done once, after the microbatches
        return ins[0]
    if name in ADDITIVE:
        others = [v for v in ins if v.tag not in ROW_FREE_LINEAR]
        if all(v.zero for v in others) and all(v.tag == SUM for v in linear):
            return Val(SUM, True)
        return Val(LIN, True)
    if name == "select_n":
        pred, cases = ins[0], ins[1:]
        if pred.tag in ROW_FREE_LINEAR or pred.params:
            return an.block(em, True, "branches on a sum over the batch", False)
        if pred.tag == INV and all(v.tag == SUM or v.zero for v in cases):
            return Val(SUM, True)
        return Val(LIN, True)
    if name in ("mul", "dot_general"):
        if len(linear) > 1:
            return an.block(em, True, "multiplies two sums over the batch", False)
        other = ins[1] if ins[0].tag in ROW_FREE_LINEAR else ins[0]
        return _scaled(an, em, linear[0], other)
    if name == "div":
        if ins[1].tag in ROW_FREE_LINEAR:
            return an.block(em, True, "divides by a sum over the batch that depends on the parameters", False)
        return _scaled(an, em, ins[0], ins[1])
    if name in ("dynamic_slice", "gather", "pad") and ins[0].tag in ROW_FREE_LINEAR:
        rest = ins[1:]
        if all(v.tag in (INV, COEF) and not v.params for v in rest):
            plain = all(v.tag == INV for v in rest) and (name != "pad" or rest[0].zero)
            return ins[0] if plain else Val(LIN, True)
    return an.block(
        em,
        True,
        f"applies `{name}` to a sum over the batch (only sums, scalings by values of "
        "the batch alone and additions of such terms are exact)",
        False,
    )


# -- values with rows -----------------------------------------------------------------------


def _axis(an: Analysis, v) -> int | None:
    axes = an.axes(v)
    return axes[0] if axes and len(axes) == 1 else None


def _rows(an: Analysis, em: JaxprEqn, ins: list[Val], rows_in: list[bool], params: bool) -> Val:
    name = em.primitive.name
    out = em.outvars[0]

    def block(reason: str) -> Val:
        return an.block(em, params, reason, an.rows(out))

    row_ins = [v for v, r in zip(ins, rows_in) if r]
    free_ins = [v for v, r in zip(ins, rows_in) if not r]
    if any(v.tag == MIX for v in row_ins):
        return block(f"`{name}` combines per-row values with values that mix the rows of the batch")
    if any(len(an.axes(v)) > 1 for v in [*em.invars, *em.outvars] if an.rows(v)):
        return block(
            f"`{name}` makes a value with two batch axes (it pairs rows of the batch with each other)"
        )
    if not any(rows_in):  # rows made from row-free values
        if name == "iota":
            return Val(MIX) if em.params["dimension"] in an.axes(out) else Val(ROW)
        if name in RANDOM and not any(v.folded for v in ins):
            return an.block(em, True, CONSTANT_KEY)
        if name == "broadcast_in_dim" or name in RANDOM or name in ELEMENTWISE:
            if all(v.tag == INV for v in ins):
                return Val(ROW, params)
            return block("spreads a value computed from the whole batch (a batch statistic) over its rows")
        return block(f"`{name}` makes rows from row-free values")
    if any(v.tag != INV for v in free_ins) and name not in ("dot_general", "gather"):
        return block(
            f"`{name}` combines per-row values with a value computed from the whole batch (a batch "
            "statistic); reduce the rows first, then scale"
        )
    a = [_axis(an, v) for v, r in zip(em.invars, rows_in) if r]
    if (
        name in ELEMENTWISE
        or name in RANDOM
        or name in IDENTITY
        or name in ("squeeze", "expand_dims", "transpose")
    ):
        return Val(ROW, params)
    if name == "broadcast_in_dim":
        return Val(ROW, params)
    if name == "reshape":
        b = _axis(an, out)
        if prefix_size(em.invars[0].aval.shape, a[0]) == 1 and prefix_size(out.aval.shape, b) == 1:
            return Val(ROW, params)
        return block("`reshape` moves the batch axis inside another axis, mixing rows")
    if name == "reduce_sum":
        return (
            Val(SUM if a[0] in em.params["axes"] else ROW, params)
            if params
            else Val(COEF if a[0] in em.params["axes"] else ROW)
        )
    if name in AXIS_PARAMS:
        touched = em.params[AXIS_PARAMS[name]]
        touched = touched if isinstance(touched, tuple) else (touched,)
        if a[0] not in touched:
            return Val(ROW, params)
        if not an.rows(out) and not params:
            return Val(COEF)
        return block(f"`{name}` runs along the batch axis (the result depends on how the batch is cut)")
    if name == "dot_general":
        return _dot(an, em, ins, rows_in, params, block)
    if name == "gather":
        return _gather(an, em, ins, rows_in, params, block)
    if name in ("slice", "dynamic_slice", "pad", "concatenate", "dynamic_update_slice"):
        return _window(an, em, ins, a[0], params, block)
    if name == "conv_general_dilated":
        dn = em.params["dimension_numbers"]
        if rows_in[0] and not rows_in[1] and dn.lhs_spec[0] == a[0] and em.params["batch_group_count"] == 1:
            return Val(ROW, params)
        return block("`conv_general_dilated` does not keep the batch axis as its batch dimension")
    return block(
        f"`{name}` on per-row values has no rule (the analysis cannot tell that each row stays its own)"
    )


def _dot(an, em, ins, rows_in, params, block) -> Val:
    (lc, rc), (lb, rb) = em.params["dimension_numbers"]
    x, y = em.invars
    if rows_in[0] and rows_in[1]:
        a, b = _axis(an, x), _axis(an, y)
        if a in lb and b in rb and lb.index(a) == rb.index(b):
            return Val(ROW, params)
        if a in lc and b in rc and lc.index(a) == rc.index(b):
            return val(SUM, params)
        return block("`dot_general` pairs rows of the batch with other rows")
    other = ins[1] if rows_in[0] else ins[0]
    if other.tag != INV:
        return block("`dot_general` combines per-row values with a value computed from the whole batch")
    return Val(ROW, params)


def _gather(an, em, ins, rows_in, params, block) -> Val:
    dn = em.params["dimension_numbers"]
    operand, indices = em.invars
    if not rows_in[0]:
        return (
            Val(ROW, params)
            if ins[0].tag == INV
            else block("`gather` reads a value computed from the whole batch")
        )
    a = _axis(an, operand)
    if rows_in[1]:
        b = _axis(an, indices)
        batching = dn.operand_batching_dims
        if a in batching and dn.start_indices_batching_dims[batching.index(a)] == b:
            return Val(ROW, params)
        return block("`gather` indexes rows of the batch with other rows' values")
    if ins[1].tag != INV:
        return block("`gather` indexes with a value computed from the whole batch")
    whole = em.params["slice_sizes"][a] == operand.aval.shape[a]
    if whole and a not in dn.start_index_map and a not in dn.collapsed_slice_dims:
        return Val(ROW, params)
    return block("`gather` selects among the rows of the batch")


def _window(an, em, ins, a: int, params: bool, block) -> Val:
    name, p = em.primitive.name, em.params
    x = em.invars[0]
    if name == "slice":
        ok = (
            p["start_indices"][a] == 0
            and p["limit_indices"][a] == x.aval.shape[a]
            and (p["strides"] is None or p["strides"][a] == 1)
        )
    elif name == "dynamic_slice":
        ok = p["slice_sizes"][a] == x.aval.shape[a]
    elif name == "dynamic_update_slice":
        ok = em.invars[1].aval.shape[a] == x.aval.shape[a] and an.rows(em.invars[1])
    elif name == "pad":
        ok = tuple(p["padding_config"][a]) == (0, 0, 0) and ins[1].tag == INV
    else:  # concatenate
        ok = p["dimension"] != a and all(an.rows(v) for v in em.invars)
    return Val(ROW, params) if ok else block(f"`{name}` cuts, pads or joins along the batch axis")


# -- calls and control flow -----------------------------------------------------------------


def _call(an: Analysis, em, ew, ins) -> list[Val]:
    (jm, cm), (jw, cw) = call_body(em), call_body(ew)
    outs = an.run(jm, jw, list(ins), (cm, cw))
    if em.primitive.name == "custom_vjp_call" and any(o.tag in (LIN, TERM) for o in outs):
        if any(an.rows(v) for v in em.invars):
            return [
                an.block(
                    em,
                    True,
                    "a custom_vjp function divides by a quantity of the batch inside; "
                    "return the sum and the count from it and divide outside",
                    False,
                )
            ] * len(outs)
    return outs


def _join(an: Analysis, em, a: Val, b: Val) -> Val:
    """The tag of a value that is `a` on one path and `b` on another."""
    return _join_tags(an, em, a, b)._replace(folded=a.folded or b.folded)


def _join_tags(an: Analysis, em, a: Val, b: Val) -> Val:
    if a == b:
        return a
    params = a.params or b.params
    if TOP in (a.tag, b.tag):
        return Val(TOP, True)
    if {a.tag, b.tag} <= {ROW, MIX}:
        return val(MIX if MIX in (a.tag, b.tag) else ROW, params)
    if a.tag in (ROW, MIX) or b.tag in (ROW, MIX):
        return an.block(em, params, "a loop or branch mixes per-row and row-free values")
    if {t.tag for t in (a, b) if not t.zero} <= {SUM}:
        return Val(SUM, True)
    if a.tag in ROW_FREE_LINEAR or b.tag in ROW_FREE_LINEAR:
        return Val(LIN, True)
    return _generic([a, b], params)


def _cond(an: Analysis, em, ew, ins) -> list[Val]:
    index, ops = ins[0], ins[1:]
    if index.params or index.tag not in (INV, COEF):
        return [
            an.block(em, True, "branches on a value that depends on the parameters or rows", False)
        ] * len(em.outvars)
    if index.tag == COEF and any(an.rows(v) for v in em.invars[1:]):
        return [
            an.block(
                em,
                True,
                "branches on a quantity of the batch around per-row values (each "
                "microbatch would take its own branch); branch after reducing the rows",
                False,
            )
        ] * len(em.outvars)
    outs = None
    for bm, bw in zip(em.params["branches"], ew.params["branches"]):
        got = an.run(bm.jaxpr, bw.jaxpr, list(ops), (bm.consts, bw.consts))
        outs = got if outs is None else [_join(an, em, a, b) for a, b in zip(outs, got)]
    if index.tag == COEF:  # the branch the whole batch takes: only after the microbatches
        outs = [val(LIN if o.tag in ROW_FREE_LINEAR else TERM, o.params) if o.tag != TOP else o for o in outs]
    return outs


def _loop(an: Analysis, em, ew, ins) -> list[Val]:
    """`scan` and `while`: the carries' tags to a fixed point; a scan over the batch axis, or a
    loop whose trip count depends on the batch or the parameters, is `TOP`."""
    scan = em.primitive.name == "scan"
    if scan:
        nc, nk = em.params["num_consts"], em.params["num_carry"]
        body_m, body_w = em.params["jaxpr"], ew.params["jaxpr"]
        xs = em.invars[nc + nk :]
        if any(an.rows(v) and 0 in an.axes(v) for v in xs):
            return [an.block(em, True, "a scan runs over the batch axis")] * len(em.outvars)
    else:
        nc, nk = em.params["body_nconsts"], len(em.outvars)
        cond_consts, ins = ins[: em.params["cond_nconsts"]], ins[em.params["cond_nconsts"] :]
        body_m, body_w = em.params["body_jaxpr"], ew.params["body_jaxpr"]
    consts, carry, xs_tags = ins[:nc], list(ins[nc : nc + nk]), ins[nc + nk :]
    for _ in range(8):
        outs = an.run(body_m.jaxpr, body_w.jaxpr, [*consts, *carry, *xs_tags], (body_m.consts, body_w.consts))
        new = [_join(an, em, c, o) for c, o in zip(carry, outs[:nk])]
        if new == carry:
            break
        carry = new
    else:
        raise StructureError("a loop's carries did not settle")
    if not scan:
        cm, cw = em.params["cond_jaxpr"], ew.params["cond_jaxpr"]
        (go,) = an.run(cm.jaxpr, cw.jaxpr, [*cond_consts, *carry], (cm.consts, cw.consts))
        if go.tag != INV:
            return [
                an.block(em, True, "a while loop's trip count depends on the batch or the parameters", False)
            ] * len(em.outvars)
        return carry
    return [*carry, *outs[nk:]]  # stacked outputs: a row value keeps its rows, a sum stays additive
