"""Evaluate some outputs of a jaxpr, computing only what they need, through calls, branches and loops.

A coefficient of the loss (a count of real tokens) may come out of a `lax.scan`
that also accumulates the loss itself; evaluating it on the whole batch must not
run the rest of that loop, nor read the parameters. `needed_inputs` finds which
inputs of an equation the wanted outputs depend on; `evaluate` runs the pruned
program with JAX's public control flow (`lax.switch`, `lax.scan`, `lax.while_loop`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jax import lax

from .jax_private import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var
from .jaxpr import EVERY_CALL as CALLS
from .jaxpr import eval_eqns, read
from .marker import sxstage_iter_p

PER_OPERAND = frozenset({sxstage_iter_p.name, "optimization_barrier"})


def _closed(body) -> tuple[Jaxpr, list]:
    return (body.jaxpr, list(body.consts)) if isinstance(body, ClosedJaxpr) else (body, [])


def _call_body(eqn: JaxprEqn) -> tuple[Jaxpr, list]:
    return _closed(eqn.params["call_jaxpr" if eqn.primitive.name.startswith("custom") else "jaxpr"])


def _needed(jaxpr: Jaxpr, wanted: Sequence[bool]) -> list[bool]:
    """Which of `jaxpr`'s inputs its wanted outputs depend on."""
    live = {
        v for v, w in zip(jaxpr.outvars, wanted) if w and isinstance(v, Var) and not isinstance(v, Literal)
    }
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if any(outs):
            live.update(
                v for v, n in zip(eqn.invars, needed_inputs(eqn, outs)) if n and not isinstance(v, Literal)
            )
    return [v in live for v in jaxpr.invars]


def _loop_carries(eqn: JaxprEqn, wanted: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """`(needed carries, needed body inputs)` of a scan or while loop, to a fixed point."""
    scan = eqn.primitive.name == "scan"
    body = eqn.params["jaxpr" if scan else "body_jaxpr"].jaxpr
    nc = eqn.params["num_consts" if scan else "body_nconsts"]
    nk = eqn.params["num_carry"] if scan else len(eqn.outvars)
    carry = list(wanted[:nk])
    if not scan:
        go = _needed(eqn.params["cond_jaxpr"].jaxpr, [True])[eqn.params["cond_nconsts"] :]
        carry = [a or b for a, b in zip(carry, go)]
    while True:
        ins = _needed(body, [*carry, *wanted[nk:]])
        more = [a or b for a, b in zip(carry, ins[nc : nc + nk])]
        if more == carry:
            return carry, ins
        carry = more


def needed_inputs(eqn: JaxprEqn, wanted: Sequence[bool]) -> list[bool]:
    """Which of `eqn`'s inputs its `wanted` outputs depend on."""
    name = eqn.primitive.name
    if name in PER_OPERAND:
        return list(wanted)
    if name in CALLS:
        return _needed(_call_body(eqn)[0], wanted)
    if name == "cond":
        branches = [_needed(b.jaxpr, wanted) for b in eqn.params["branches"]]
        return [True, *(any(col) for col in zip(*branches))]
    if name == "scan":
        carry, ins = _loop_carries(eqn, wanted)
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        return [*ins[:nc], *carry, *ins[nc + nk :]]
    if name == "while":
        carry, ins = _loop_carries(eqn, wanted)
        cn = eqn.params["cond_nconsts"]
        go = _needed(eqn.params["cond_jaxpr"].jaxpr, [True])
        return [*go[:cn], *ins[: eqn.params["body_nconsts"]], *carry]
    return [any(wanted)] * len(eqn.invars)


def _plan(jaxpr: Jaxpr, targets: Sequence) -> tuple[list, set]:
    """The equations `targets` need, in order, each with its wanted outputs; and every variable read."""
    live = {v for v in targets if isinstance(v, Var) and not isinstance(v, Literal)}
    plan = []
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if any(outs):
            plan.append((eqn, outs))
            live.update(
                v for v, n in zip(eqn.invars, needed_inputs(eqn, outs)) if n and not isinstance(v, Literal)
            )
    return plan[::-1], live


def reads(jaxpr: Jaxpr, targets: Sequence) -> list[bool]:
    """Per input of `jaxpr`: whether `targets` depend on it."""
    return [v in _plan(jaxpr, targets)[1] for v in jaxpr.invars]


def evaluate(jaxpr: Jaxpr, consts: Sequence, inputs: dict, targets: Sequence) -> list:
    """`targets` (variables or literals of `jaxpr`) from `inputs` (`{invar: value}`, at least those
    needed) and `consts`, evaluating only the equations and loop carries they depend on."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(inputs)
    for eqn, outs in _plan(jaxpr, targets)[0]:
        run_wanted(eqn, outs, env)
    return [read(env, v) for v in targets]


def _sub(body, wanted: Sequence[bool]):
    """`f(*needed inputs) -> wanted outputs` of a closed sub-jaxpr, and which inputs it needs."""
    jaxpr, consts = _closed(body)
    need = _needed(jaxpr, wanted)
    ins = [v for v, n in zip(jaxpr.invars, need) if n]
    outs = [v for v, w in zip(jaxpr.outvars, wanted) if w]
    return (lambda *xs: evaluate(jaxpr, consts, dict(zip(ins, xs)), outs)), need


def run_wanted(eqn: JaxprEqn, wanted: list[bool], env: dict) -> None:
    """Evaluate `eqn`'s `wanted` outputs into `env`, running only what they need."""
    name = eqn.primitive.name
    vals = [
        read(env, v) if (not isinstance(v, Var) or isinstance(v, Literal) or v in env) else None
        for v in eqn.invars
    ]
    pick = lambda mask, xs: [x for x, n in zip(xs, mask) if n]
    if name in CALLS:
        fn, need = _sub(eqn.params["call_jaxpr" if name.startswith("custom") else "jaxpr"], wanted)
        got = fn(*pick(need, vals))
    elif name == "cond":
        fns = [_sub(b, wanted) for b in eqn.params["branches"]]
        need = [any(col) for col in zip(*(n for _, n in fns))]
        ops = pick(need, vals[1:])
        got = lax.switch(vals[0], [lambda *o, f=f, n=n: f(*pick(n, _spread(need, o))) for f, n in fns], *ops)
    elif name in ("scan", "while"):
        got = _loop(eqn, wanted, vals)
    elif name in PER_OPERAND:
        got = pick(wanted, vals)
    else:
        eval_eqns([eqn], env)
        return
    for v, x in zip(pick(wanted, eqn.outvars), got):
        env[v] = x


def _spread(mask: Sequence[bool], values: Sequence) -> list:
    """`values` back at the positions where `mask` holds (None elsewhere)."""
    it = iter(values)
    return [next(it) if n else None for n in mask]


def _loop(eqn: JaxprEqn, wanted: list[bool], vals: list) -> list:
    carry, _ = _loop_carries(eqn, wanted)
    if eqn.primitive.name == "scan":
        p = eqn.params
        nc, nk = p["num_consts"], p["num_carry"]
        ys = wanted[nk:]
        body, need = _sub(p["jaxpr"], [*carry, *ys])
        consts, init, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
        bc, bk, bx = need[:nc], need[nc : nc + nk], need[nc + nk :]

        def step(c, x):
            own = [a for a, n in zip(_spread(carry, c), bk) if n]
            outs = body(*[a for a, n in zip(consts, bc) if n], *own, *x)
            k = sum(carry)
            return tuple(outs[:k]), tuple(outs[k:])

        kept = tuple(a for a, n in zip(init, carry) if n)
        last, stacked = lax.scan(
            step, kept, tuple(a for a, n in zip(xs, bx) if n), length=p["length"], reverse=p["reverse"]
        )
        full_carry = _spread(carry, last)
        return [*(c for c, w in zip(full_carry, wanted[:nk]) if w), *stacked]
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = vals[:cn], vals[cn : cn + bn], vals[cn + bn :]
    go, go_need = _sub(p["cond_jaxpr"], [True])
    body, need = _sub(p["body_jaxpr"], carry)
    kept = tuple(a for a, n in zip(init, carry) if n)

    def cond(c):
        full = [*cconsts, *_spread(carry, c)]
        return go(*[a for a, n in zip(full, go_need) if n])[0]

    def step(c):
        full = [*bconsts, *_spread(carry, c)]
        return tuple(body(*[a for a, n in zip(full, need) if n]))

    last = _spread(carry, lax.while_loop(cond, step, kept))
    return [c for c, w in zip(last, wanted) if w]
