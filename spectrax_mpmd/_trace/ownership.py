"""Split a program by ownership: each equation runs on the pipeline rank that holds its inputs.

The code after a pipelined backward (an optimizer update, clipping, metrics)
reads values that live on different ranks: each parameter's gradient on its
owner rank, the loss on the last. `partition` assigns every equation of such a
program to a rank and cuts it into pieces, one per `(rank, phase)`:

* an equation whose owned inputs all live on one rank runs there;
* an equation reading several ranks runs where most of its input bytes are, and
  the other inputs cross to it (a global norm's partial sums, a clipping scale,
  a finiteness flag: the small arrays they are);
* an equation reading no owned value (a step counter, a learning-rate schedule)
  is owned by nobody: every piece that needs it recomputes it, and an input
  owned by nobody (an optimizer's moments) is placed on each rank that reads it;
* a piece's phase counts the rank crossings on the longest path into it, so a
  piece waits only for pieces of earlier phases, and a rank's phase-0 piece
  needs nothing from any other rank.

A `cond` whose operands span ranks is split into one `cond` per rank when each
of its outputs depends on one rank's arrays (besides scalars, which cross, and
unowned values), so a per-leaf update gated by a global flag stays on each
leaf's rank. A constant predicate (a literal, as in `optax.MultiSteps`) is owned
by nobody, like any value computed from constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import numpy as np

from .jax_private import ClosedJaxpr, Literal, Var
from .jaxpr import EVERY_CALL, eval_eqns, inline_calls, needed_eqns, read, resolve

# primitives whose output keeps an operand's shape without keeping its layout
_RELAYOUT = frozenset({"dot_general", "transpose", "rev", "gather", "dynamic_slice", "conv_general_dilated"})


@dataclass(frozen=True, eq=False)
class SplitCond:
    """The outputs `positions` of a `cond` equation, computed from `invars` only (a rank's share)."""

    index: Var | Literal
    operands: tuple  # (position among the cond's operands, var)
    branches: tuple  # the cond's ClosedJaxprs
    positions: tuple
    outvars: tuple

    @property
    def invars(self) -> tuple:
        return (self.index, *(v for _, v in self.operands))

    def run(self, env: dict) -> None:
        args = [read(env, v) for _, v in self.operands]

        def branch(b: ClosedJaxpr) -> Callable:
            keep = sorted(needed_eqns(b.jaxpr.eqns, [b.jaxpr.outvars[k] for k in self.positions]))

            def evaluate(*ops):  # only the equations this share's outputs need
                local = dict(zip(b.jaxpr.constvars, b.consts))
                local.update({b.jaxpr.invars[p]: x for (p, _), x in zip(self.operands, ops)})
                eval_eqns([b.jaxpr.eqns[i] for i in keep], local)
                return tuple(read(local, b.jaxpr.outvars[k]) for k in self.positions)

            return evaluate

        outs = jax.lax.switch(read(env, self.index), [branch(b) for b in self.branches], *args)
        env.update(zip(self.outvars, outs))


@dataclass(frozen=True, eq=False)
class Piece:
    """The equations one rank runs in one phase: reads `ins`, makes `outs` for others."""

    rank: int
    phase: int
    ops: tuple  # JaxprEqns and SplitConds, in program order
    ins: tuple
    outs: tuple

    def function(self, consts: dict) -> Callable:
        """`f(*ins) -> outs`, evaluating the piece's equations (constants closed over)."""
        ops, ins, outs = self.ops, self.ins, self.outs

        def piece(*args):
            env = dict(consts)
            env.update(zip(ins, args))
            for op in ops:
                if isinstance(op, SplitCond):
                    op.run(env)
                else:
                    eval_eqns([op], env)
            return tuple(read(env, v) for v in outs)

        return piece


@dataclass(frozen=True, eq=False)
class Partition:
    """A program cut into pieces. `home[v]` is the rank a value lives on (None: owned by nobody;
    an input owned by nobody is placed on each rank whose pieces read it). `outvars` are the
    program's outputs after inlining (vars or literals), `unowned` those owned by nobody (made
    on the default rank, or an unowned input passed through); `like[v]` names the owned input
    whose layout `v` shares (same shape, reached through elementwise equations), if any."""

    pieces: tuple
    invars: tuple
    outvars: tuple
    consts: dict
    home: dict
    like: dict
    unowned: frozenset


def _bytes(v) -> int:
    aval = v.aval
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize if aval.shape else 1


def _vars(seq) -> list:
    return [v for v in seq if isinstance(v, Var) and not isinstance(v, Literal)]


def _owner(home: dict, v) -> int | None:
    """The rank operand `v` lives on; a literal (a constant predicate) is owned by nobody."""
    return None if isinstance(v, Literal) else home.get(v)


def _dependencies(closed: ClosedJaxpr) -> list[set[int]]:
    """For each output of `closed`, the positions of the inputs it depends on."""
    jaxpr = closed.jaxpr
    pos = {v: k for k, v in enumerate(jaxpr.invars)}
    deps: dict = {v: {k} for v, k in pos.items()}
    for eqn in jaxpr.eqns:
        got = set().union(*(deps.get(v, set()) for v in _vars(eqn.invars)))
        for v in _vars(eqn.outvars):
            deps[v] = got
    return [set(deps.get(v, set())) if isinstance(v, Var) else set() for v in jaxpr.outvars]


def _split_cond(eqn, home: dict) -> list[tuple[int | None, SplitCond]] | None:
    """`eqn` (a cond) as one `SplitCond` per rank, or None when an output needs two ranks."""
    index, ops = eqn.invars[0], eqn.invars[1:]
    branches = eqn.params["branches"]
    deps = [set() for _ in eqn.outvars]
    for b in branches:
        for k, d in enumerate(_dependencies(b)):
            deps[k] |= d
    groups: dict = {}
    for k, d in enumerate(deps):  # a scalar operand crosses to the share that reads it
        ranks = {_owner(home, ops[p]) for p in d if ops[p].aval.shape} - {None}
        if len(ranks) > 1:
            return None
        groups.setdefault(next(iter(ranks)) if ranks else None, []).append(k)
    out = []
    for rank, positions in groups.items():
        used = sorted(set().union(*(deps[k] for k in positions)))
        out.append(
            (
                rank,
                SplitCond(
                    index,
                    tuple((p, ops[p]) for p in used),
                    tuple(branches),
                    tuple(positions),
                    tuple(eqn.outvars[k] for k in positions),
                ),
            )
        )
    return out


def _like(ops, invars: Sequence, owners: Sequence) -> dict:
    """`var -> owned input` whose shape and layout it shares, by union over elementwise equations."""
    parent: dict = {}

    def find(v):
        while parent.get(v, v) is not v:
            v = parent[v]
        return v

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra is not rb:
            parent[ra] = rb

    for op in ops:
        if isinstance(op, SplitCond) or op.primitive.name in _RELAYOUT:
            continue
        vs = [v for v in (*_vars(op.invars), *_vars(op.outvars)) if v.aval.shape]
        for v in vs[1:]:
            if v.aval.shape == vs[0].aval.shape:
                union(v, vs[0])
    roots: dict = {}
    for v, owner in zip(invars, owners):
        if owner is not None and isinstance(v, Var):
            roots.setdefault(find(v), v)
    seen = {v for op in ops for v in (*_vars(op.invars), *_vars(op.outvars))} | set(_vars(invars))
    return {v: roots[find(v)] for v in seen if find(v) in roots}


@dataclass(frozen=True)
class Program:
    """A flat program: equations (calls inlined) over `invars`, with `outvars` and constants."""

    eqns: tuple
    invars: tuple
    outvars: tuple
    consts: dict

    @classmethod
    def of(cls, closed: ClosedJaxpr) -> "Program":
        jaxpr = closed.jaxpr
        eqns, mapping, inner, _ = inline_calls(jaxpr, lambda e: e.primitive.name in EVERY_CALL)
        consts = dict(zip(jaxpr.constvars, closed.consts)) | inner
        return cls(
            tuple(eqns), tuple(jaxpr.invars), tuple(resolve(v, mapping) for v in jaxpr.outvars), consts
        )


def partition(program: Program, owners: Sequence[int | None], default_rank: int) -> Partition:
    """Cut `program` into pieces by ownership. `owners[k]` is the rank holding input `k` (None:
    owned by nobody); outputs owned by nobody are made on `default_rank`."""
    home: dict = {v: r for v, r in zip(program.invars, owners)}
    phase: dict = {}
    ops: list = []  # (op, rank or None, phase)
    for eqn in program.eqns:
        ranks = {home[v] for v in _vars(eqn.invars) if home.get(v) is not None}
        if len(ranks) > 1 and eqn.primitive.name == "cond":
            split = _split_cond(eqn, home)
            if split is not None:
                for rank, op in split:  # a share reading no owned operand runs with the predicate
                    _place(op, _owner(home, op.index) if rank is None else rank, home, phase, ops)
                continue
        if len(ranks) > 1:
            weight: dict = {}
            for v in _vars(eqn.invars):
                if home.get(v) is not None:
                    weight[home[v]] = weight.get(home[v], 0) + _bytes(v)
            ranks = {max(sorted(weight), key=lambda r: weight[r])}
        _place(eqn, next(iter(ranks)) if ranks else None, home, phase, ops)
    inputs = set(program.invars)
    unowned = frozenset(v for v in _vars(program.outvars) if home.get(v) is None)
    for v in unowned - inputs:
        home[v] = default_rank  # an unowned output: made by default_rank's first piece
    pieces = _pieces(ops, program.outvars, home, default_rank)
    like = _like([op for op, _, _ in ops], program.invars, owners)
    return Partition(tuple(pieces), program.invars, program.outvars, program.consts, home, like, unowned)


def _place(op, rank, home: dict, phase: dict, ops: list) -> None:
    if rank is None:
        ops.append((op, None, 0))
        for v in _vars(op.outvars):
            home[v] = None
        return
    k = max(
        (phase.get(v, 0) + (home[v] != rank) for v in _vars(op.invars) if home.get(v) is not None),
        default=0,
    )
    ops.append((op, rank, k))
    for v in _vars(op.outvars):
        home[v], phase[v] = rank, k


def _pieces(ops: list, outvars, home: dict, default_rank: int) -> list[Piece]:
    groups: dict = {}
    unowned_defs: dict = {}
    for j, (op, rank, k) in enumerate(ops):
        if rank is None:
            for v in _vars(op.outvars):
                unowned_defs[v] = j
        else:
            groups.setdefault((rank, k), []).append(j)
    made_unowned = [v for v in _vars(outvars) if v in unowned_defs]
    if made_unowned:
        groups.setdefault((default_rank, 0), [])
    readers: dict = {}
    for key, members in groups.items():
        for j in members:
            for v in _vars(ops[j][0].invars):
                readers.setdefault(v, set()).add(key)
    pieces = []
    for key in sorted(groups, key=lambda rk: (rk[1], rk[0])):
        rank, k = key
        members = set(groups[key])
        wanted = [v for j in members for v in _vars(ops[j][0].invars)]
        if key == (default_rank, 0):
            wanted += made_unowned
        stack = [unowned_defs[v] for v in wanted if v in unowned_defs]
        while stack:  # recompute the unowned values this piece reads
            j = stack.pop()
            if j not in members:
                members.add(j)
                stack += [unowned_defs[v] for v in _vars(ops[j][0].invars) if v in unowned_defs]
        chosen = [ops[j][0] for j in sorted(members)]
        made = {v for op in chosen for v in _vars(op.outvars)}
        ins = tuple(dict.fromkeys(v for op in chosen for v in _vars(op.invars) if v not in made))
        final = set(_vars(outvars))
        outs = tuple(
            v
            for v in dict.fromkeys(v for op in chosen for v in _vars(op.outvars))
            if home.get(v) == rank and (v in final or any(r != key for r in readers.get(v, ())))
        )
        pieces.append(Piece(rank, k, tuple(chosen), ins, outs))
    return pieces
