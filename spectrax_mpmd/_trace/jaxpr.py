"""Small jaxpr utilities: evaluate equation lists, inline call equations, slice by dependency."""

from __future__ import annotations

from typing import Callable, Collection, Iterable, Iterator, Sequence

from .jax_private import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Var

CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"})
CONTROL_FLOW_PRIMITIVES = frozenset({"scan", "while", "cond"})
# calls with a differentiation rule of their own: inlined only where nothing differentiates them again
CUSTOM_CALL_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call"})
EVERY_CALL = CALL_PRIMITIVES | CUSTOM_CALL_PRIMITIVES


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """Every jaxpr held in `eqn`'s params (call bodies, loop bodies, cond branches)."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, Jaxpr):
                yield item


def contains_primitive(jaxpr: Jaxpr, name: str) -> bool:
    """Whether `name` occurs anywhere in `jaxpr`, nested jaxprs included."""
    return any(
        eqn.primitive.name == name or any(contains_primitive(j, name) for j in sub_jaxprs(eqn))
        for eqn in jaxpr.eqns
    )


def read(env: dict, v):
    return v.val if isinstance(v, Literal) else env[v]


def eval_eqns(eqns: Iterable[JaxprEqn], env: dict, identities: Collection[str] = ()) -> dict:
    """Evaluate `eqns` in order (binding each primitive), filling `env` with their outputs; an
    equation of a primitive named in `identities` is not bound: its outputs are its inputs."""
    for eqn in eqns:
        invals = [read(env, v) for v in eqn.invars]
        if eqn.primitive.name in identities:
            env.update((var, val) for var, val in zip(eqn.outvars, invals) if isinstance(var, Var))
            continue
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **params)
        if not eqn.primitive.multiple_results:
            outs = (outs,)
        for var, val in zip(eqn.outvars, outs):
            if isinstance(var, Var):
                env[var] = val
    return env


def _fresh_outvars(eqn: JaxprEqn, mapping: dict) -> JaxprEqn:
    """Copy `eqn` reading renamed inputs and writing fresh variables (recorded in `mapping`)."""
    invars = [v if isinstance(v, Literal) else mapping.get(v, v) for v in eqn.invars]
    outvars = []
    for v in eqn.outvars:
        if isinstance(v, DropVar) or not isinstance(v, Var):
            outvars.append(v)
        else:
            mapping[v] = new = Var(v.aval)
            outvars.append(new)
    return eqn.replace(invars=invars, outvars=outvars)


def name_stack(eqn: JaxprEqn) -> str:
    """The `jax.named_scope` names the equation was traced under, joined by `/` (relative to the
    call it sits in)."""
    return str(eqn.source_info.name_stack)


def inline_calls(
    jaxpr: Jaxpr, should_inline: Callable[[JaxprEqn], bool]
) -> tuple[list[JaxprEqn], dict, dict, list[str]]:
    """Flatten call equations (jit, checkpoint) for which `should_inline` holds, recursively.

    Returns the flat equation list, a renaming map (apply it with `resolve` to
    the outer jaxpr's outputs), a `{constvar: value}` map of the constants of
    inlined closed jaxprs and, per equation, its full name stack (an inlined
    equation's own under its call's). Every inlined equation writes fresh
    variables, so a helper called several times is inlined several times
    without clashes.
    """
    inner_consts: dict = {}
    out: list[JaxprEqn] = []
    scopes: list[str] = []

    def walk(eqns: Sequence[JaxprEqn], mapping: dict, fresh: bool, prefix: str) -> None:
        for eqn in eqns:
            scope = "/".join(x for x in (prefix, name_stack(eqn)) if x)
            name = eqn.primitive.name
            if (name in CALL_PRIMITIVES or name in CUSTOM_CALL_PRIMITIVES) and should_inline(eqn):
                # jit and checkpoint name their body `jaxpr`; closed_call and custom calls `call_jaxpr`
                body = eqn.params["jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"]
                inner = body.jaxpr if isinstance(body, ClosedJaxpr) else body
                inner_map: dict = {}
                for cv, val in zip(inner.constvars, getattr(body, "consts", ())):
                    inner_map[cv] = fresh = Var(cv.aval)
                    inner_consts[fresh] = val
                for iv, ov in zip(inner.invars, eqn.invars):
                    inner_map[iv] = ov if isinstance(ov, Literal) else mapping.get(ov, ov)
                walk(inner.eqns, inner_map, True, scope)
                for outer, res in zip(eqn.outvars, inner.outvars):
                    if isinstance(outer, Var) and not isinstance(outer, DropVar):
                        mapping[outer] = res if isinstance(res, Literal) else inner_map.get(res, res)
            elif fresh:
                out.append(_fresh_outvars(eqn, mapping))
                scopes.append(scope)
            else:
                invars = [v if isinstance(v, Literal) else mapping.get(v, v) for v in eqn.invars]
                out.append(eqn.replace(invars=invars))
                scopes.append(scope)

    top: dict = {}
    walk(jaxpr.eqns, top, False, "")
    return out, top, inner_consts, scopes


def resolve(v, mapping: dict):
    """The variable (or literal) that holds outer variable `v` after `inline_calls`."""
    return v if isinstance(v, Literal) else mapping.get(v, v)


def producers(eqns: Sequence[JaxprEqn]) -> dict:
    """Map each variable to the index of the equation defining it."""
    return {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars if isinstance(v, Var)}


def needed_eqns(eqns: Sequence[JaxprEqn], targets: Iterable) -> set[int]:
    """Indices of the equations that the variables `targets` depend on."""
    defined = producers(eqns)
    seen: set[int] = set()
    stack = [defined[v] for v in targets if not isinstance(v, Literal) and v in defined]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack.extend(defined[v] for v in eqns[i].invars if not isinstance(v, Literal) and v in defined)
    return seen
