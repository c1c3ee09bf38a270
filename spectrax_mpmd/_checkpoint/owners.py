"""Parameters and optimizer state made on the ranks that keep them, not placed whole on one device.

`owner_layout(step, init, key, *batch)` builds the step's plan on abstract arguments
(`jax.eval_shape` of `init` and of `tx.init`) and reads there where the step keeps each
leaf (`kept_shardings`: the sharding the step returns the leaf with, else that of its
first reader). `init_on_owners` then makes the leaves (`owner_programs.make_leaves`): per
device set, compiled programs of the equations of `init`'s jaxpr (and of `tx.init` of its
result) that the set's leaves need, their outputs sharded as the step keeps them, so the values
are those of `jax.jit(init)(key)` and a rank computes and holds its own leaves and nothing
else. In a multi-process run a process makes only
the leaves of its own ranks; the others are global arrays without local shards here,
as the step returns them. Both entry points trace `init` (and `tx.init`), so they must be
traceable; both run with the caller's context mesh cleared, as every step does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core import sharding as core_sharding

from .._api.entry import cached_entry
from .._runtime import Output
from .._trace.context import outside_context_mesh
from ..errors import MpmdError
from .owner_programs import make_leaves, rank_programs

NAME = "init_on_owners"
UNTRACEABLE = (  # Python reading a value being traced
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def kept_shardings(plan, first: int, count: int, results: int | None) -> list:
    """Per function leaf `first .. first + count - 1`, where `plan` keeps it: the sharding of the
    result it comes back as (`results`: the index of its first result, None: a plan without
    results), else of its first reader, else None (a leaf the plan neither reads nor returns)."""
    produced = plan.produced_shardings()
    produced.update((slot, value.sharding) for slot, value in plan.remote_outputs)
    readers: dict = {}
    for (_, key), sharding in zip(plan.input_keys, plan.input_shardings):
        readers.setdefault(key.leaf, sharding)
    slots = plan.output_slots.get(Output.RESULTS, ())
    out = []
    for j in range(count):
        slot = slots[results + j] if results is not None else None
        out.append(produced.get(slot, readers.get(first + j)))
    return out


def _step_of(step, tx, name: str):
    """`(the Runner behind a runner step or None, the optimizer or None)`, or an error saying which
    steps are taken."""
    inner = getattr(step, "runner", None)
    if inner is not None:
        if inner.mode != "train":
            raise MpmdError(
                f"{name}: step is a forward (inference) step; parameters are placed by a training step: "
                "pass an mp.runner(..., mode='train') step."
            )
        tx = inner.tx if tx is None else tx
        return inner, tx
    if not hasattr(step, "build_entry"):
        raise MpmdError(
            f"{name}: step must be an mp.runner(...) step, an mp.sxvalue_and_grad_and_apply step or an "
            f"mp.sxvalue_and_grad function, got {type(step).__name__}."
        )
    if not hasattr(step, "plan_for") and tx is None:
        raise MpmdError(
            f"{name}: step is a whole training step (params, opt_state, *batch); pass its optimizer as "
            "tx= so that the optimizer state is made with it."
        )
    return None, tx


def _shardings(step, inner, abstract, batch, tx, companion=None) -> tuple[list, object]:
    """`(per leaf of abstract (the parameters, or (params, opt_state)), where step keeps it; the
    compiler of the step's programs, None without a pipeline axis)` (`inner`: the `Runner` behind a
    runner step, else None). `companion(plan_specs)` gives more specs to compile with the step's."""
    leaves = jax.tree.leaves(abstract)
    if inner is not None and not inner.mpmd:
        return _spmd_shardings(inner, abstract, tx), None
    if inner is not None:
        step = inner.update_step if tx is not None else inner.step
        batch = (None, *batch)
    call = (abstract, *batch) if tx is None else (*abstract, *batch)
    with _alongside(step.compiler, companion):
        plan = step.plan_for(*call) if tx is None else cached_entry(step, call)[0].plan
    return kept_by(plan, len(leaves), tx), step.compiler


def kept_by(plan, n_leaves: int, tx) -> list:
    """Where `plan` keeps each of `n_leaves` leaves: a gradient plan where it makes the leaf's
    gradient, a whole step's where it returns it (`tx`: the step's optimizer)."""
    if tx is None:
        found = plan.grad_shardings(n_leaves)
        return [found.get(a) for a in range(n_leaves)]
    n_results = len(plan.output_slots.get(Output.RESULTS, ()))
    return kept_shardings(plan, 0, n_leaves, n_results - n_leaves)


@contextlib.contextmanager
def _alongside(compiler, companion):
    """`companion` among `compiler`'s companions while the block runs (nothing when None)."""
    if companion is not None:
        compiler.companions.append(companion)
    try:
        yield
    finally:
        if companion is not None:
            compiler.companions.remove(companion)


def _spmd_shardings(inner, abstract, tx) -> list:
    """A step without a pipeline axis: parameters placed by its rules (replicated without), the
    optimizer state replicated, as `Runner.update` places them."""
    mesh = inner.mesh
    params = abstract[0] if tx is not None else abstract
    if inner.rules is None:
        placed = [NamedSharding(mesh, PartitionSpec()) for _ in jax.tree.leaves(params)]
    else:
        specs = core_sharding.param_specs(params, inner.rules, mesh=mesh)
        placed = [NamedSharding(mesh, s) for s in jax.tree.leaves(specs, is_leaf=_is_spec)]
    if tx is None:
        return placed
    return placed + [NamedSharding(mesh, PartitionSpec()) for _ in jax.tree.leaves(abstract[1])]


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def traced(fn: Callable, key, name: str) -> tuple:
    """`(jaxpr, tree of ShapeDtypeStructs)` of `fn(key)`; an init that reads a traced value in
    Python is an error naming `name`, the rule and the fix, chained from JAX's."""
    try:
        return jax.make_jaxpr(fn, return_shape=True)(key)
    except UNTRACEABLE as e:
        first = str(e).strip().splitlines()[0]
        raise MpmdError(
            f"{name}: init must be traceable: it is traced (like jax.jit traces a function) to find "
            "where each leaf is kept and which equations each rank needs, and a Python `if`, `while`, "
            f"`float(...)`, `int(...)` or `np.asarray(...)` on a value it computes fails there ({first}). "
            "Write such a choice with jnp.where or jax.lax.cond (a loop with jax.lax.while_loop), or "
            "compute the value outside init and pass it with functools.partial."
        ) from e


def _layout(step, init: Callable, key, batch: tuple, tx, name: str, make: bool = False) -> tuple:
    """`(jaxpr of the leaves to make, their tree of ShapeDtypeStructs with the owners' shardings,
    the compiler holding their programs or None, the programs (`rank_programs`) where they were
    made while building the step, else None)`. With `make`, the programs that make the leaves on
    their ranks compile together with the step's (see `owner_programs`)."""
    inner, tx = _step_of(step, tx, name)
    closed, abstract = traced(_maker(init, tx), key, name)
    leaves, treedef = jax.tree.flatten(abstract)
    made: list = []

    def companion(plan) -> list:
        shardings = kept_by(plan, len(leaves), tx)
        if None in shardings:
            return []
        made.append(rank_programs(closed, key, shardings))
        return [spec for _, spec, _ in made[-1]]

    shardings, compiler = _shardings(step, inner, abstract, batch, tx, companion if make else None)
    if None in shardings:
        fallback = _fallback(step)
        shardings = [fallback if sh is None else sh for sh in shardings]
    placed = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x, sh in zip(leaves, shardings)]
    return closed, treedef.unflatten(placed), compiler, made[-1] if made else None


@outside_context_mesh
def owner_layout(step, init: Callable, key, *batch, tx=None):
    """Where `step` keeps each leaf of `init(key)` (and of its optimizer state): the same tree of
    `jax.ShapeDtypeStruct`s, each with the sharding of the rank(s) that keep it. Nothing is
    computed but the step's plan (see `init_on_owners`, which takes the same arguments).

    Pass the trees to a restore as `like=` and `opt_like=`, so that every array is read
    straight onto its rank: `params, opt_state = mp.owner_layout(step, init, key, *batch)`,
    then `manager.restore(like=params, opt_like=opt_state)`.
    """
    return _layout(step, init, key, batch, tx, "owner_layout")[1]


@outside_context_mesh
def init_on_owners(step, init: Callable, key, *batch, tx=None):
    """`init(key)` made leaf by leaf on the ranks where `step` keeps each leaf: never whole on one
    device, with the values of `jax.jit(init)(key)`.

    `step` is an `mp.runner(...)` step (its `tx` gives the optimizer), an
    `mp.sxvalue_and_grad_and_apply` step (pass its `tx=`), or an `mp.sxvalue_and_grad`
    function; `batch` are the step's arguments after the parameters (and the optimizer
    state), arrays or `jax.ShapeDtypeStruct`s of the batch the step will be called with.
    `key` is `init`'s argument (a PRNG key, or any pytree of arrays; bind other arguments
    with `functools.partial`). With an optimizer returns `(params, opt_state)`, the state
    `tx.init(params)` made on the ranks that update each leaf, both ready for
    `step.update(params, opt_state, *batch)`; without one, the parameters placed where the
    step makes their gradients.

    This builds (and compiles) the step's plan for these arguments; the first real call
    reuses it. `init` (and `tx.init`) is traced once, so it must be traceable: a choice on a
    value it computes is written with `jnp.where` or `jax.lax.cond`, not a Python `if`. Each
    device set then runs compiled programs of only the equations its own leaves need, with
    their shardings as `out_shardings` (so the values are those of `jax.jit(init)(key)` on one
    device, see docs/large-models.md); no device keeps more than its own share (a program's
    temporaries can hold more, see there). In a multi-process run
    each process makes only its ranks' leaves.
    """
    closed, layout, compiler, programs = _layout(step, init, key, batch, tx, NAME, make=True)
    leaves, treedef = jax.tree.flatten(layout)
    shardings = [x.sharding for x in leaves]
    return treedef.unflatten(make_leaves(closed, key, shardings, leaves, compiler, programs))


def _maker(init: Callable, tx) -> Callable:
    """`init`, or with an optimizer `key -> (init(key), tx.init(init(key)))`."""
    return init if tx is None else (lambda key: _with_state(init, tx, key))


def _with_state(init: Callable, tx, key):
    params = init(key)
    return params, tx.init(params)


def _fallback(step):
    """Where a leaf the step never reads goes: replicated on the first rank."""
    inner = getattr(step, "runner", None)
    mesh = (inner if inner is not None else step).mesh
    return NamedSharding(mesh.submesh(0), PartitionSpec())
