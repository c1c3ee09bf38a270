"""The four kinds of positional argument, and the signature that keys a traced plan.

* parameters (`argnums`): differentiated, never split;
* batch (`batch_argnums`, default every other non-static argument): split on
  the leading axis into microbatches, which every batch leaf shares;
* broadcast (every other non-static argument): the same value for every
  microbatch; a PRNG key among them is folded with the microbatch index;
* static (`static_argnums`): Python values hashed into the key and bound
  into the traced function.

A `Signature` is everything about one call that changes the traced program:
the static values (with their types), the argument tree, each leaf's shape,
dtype and weak type, and JAX's trace-affecting configuration.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..errors import MpmdError
from .context import config_key


def as_tuple(argnums) -> tuple[int, ...]:
    if argnums is None:
        return ()
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def positional_names(fn: Callable) -> list[str]:
    """The names of `fn`'s positional parameters (none where they cannot be read)."""
    try:
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def describe_argument(fn: Callable, k: int) -> str:
    """`argument 2 ('mask')`: the position, with the parameter's name when it can be read."""
    names = positional_names(fn)
    return f"argument {k} ({names[k]!r})" if k < len(names) else f"argument {k}"


def is_prng_key(shape: tuple, dtype) -> bool:
    """A typed key array, or a legacy raw key (`uint32[2]`)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return dtype == np.uint32 and tuple(shape) == (2,)


def fold_key(key, idx):
    """Microbatch `idx`'s key: `jax.random.fold_in` of a typed key array (any shape) or a raw key."""
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.ndim == 0:
        return jax.random.fold_in(key, idx)
    folded = jax.vmap(jax.random.fold_in, in_axes=(0, None))(key.reshape(-1), idx)
    return folded.reshape(key.shape)


@dataclass(frozen=True)
class Signature:
    """One call's arguments as the runtime keys and traces them."""

    key: tuple
    statics: tuple  # (position, value) pairs
    positions: tuple[int, ...]  # positions of the dynamic (non-static) arguments
    leaves: list
    in_tree: Any
    types: tuple  # per leaf: (shape, dtype, weak_type)

    def aval(self, a: int, shape: tuple | None = None) -> jax.ShapeDtypeStruct:
        """Leaf `a`'s abstract value (weak type kept), optionally with another shape."""
        leaf_shape, dtype, weak = self.types[a]
        return jax.ShapeDtypeStruct(leaf_shape if shape is None else shape, dtype, weak_type=weak)

    def ranges(self) -> list[range]:
        """The flat-leaf indices of each dynamic argument, aligned with `positions`."""
        out, start = [], 0
        for arg in self.in_tree.children():
            out.append(range(start, start + arg.num_leaves))
            start += arg.num_leaves
        return out

    def describe(self, fn: Callable, a: int) -> str:
        """Leaf `a` for an error message: `argument 2 ('batch')['mask']`."""
        return _describe_leaf(fn, self.positions, self.in_tree.unflatten(self.leaves), a)

    def arguments(self) -> list:
        """The call's positional arguments again (statics and the trees of its leaves)."""
        statics, dynamic = (
            dict(self.statics),
            iter(self.in_tree.unflatten(self.leaves[: self.in_tree.num_leaves])),
        )
        return [
            statics[k] if k in statics else next(dynamic) for k in range(len(self.positions) + len(statics))
        ]

    def bind(self, fn: Callable) -> Callable:
        """`fn` as a function of the dynamic arguments only, statics bound in."""
        statics, total = dict(self.statics), len(self.positions) + len(self.statics)

        def bound(*dynamic):
            it = iter(dynamic)
            return fn(*[statics[k] if k in statics else next(it) for k in range(total)])

        return bound


def _normalize(name: str, label: str, nums: tuple[int, ...], n_args: int) -> tuple[int, ...]:
    out = []
    for k in nums:
        if not -n_args <= k < n_args:
            raise MpmdError(f"{name}: {label}={nums}, but the call has {n_args} positional argument(s).")
        out.append(k % n_args)
    return tuple(out)


def _describe_leaf(fn: Callable, positions: tuple[int, ...], dynamic: tuple, a: int) -> str:
    path = jax.tree_util.tree_flatten_with_path(dynamic)[0][a][0]
    return describe_argument(fn, positions[path[0].idx]) + jax.tree_util.keystr(path[1:])


class _DeletedLeaf(Exception):
    """Raised by `_leaf_type` for a deleted array; `signature` turns it into an `MpmdError`."""


# the calls that consume (delete) their arguments, as a deleted-array error names them
DONATING_CALLS = (
    "sxjit with donate_argnums, sxvalue_and_grad_and_apply with donate=True (the default) or the "
    "update step of a runner built with tx="
)


def _leaf_type(leaf, live: bool) -> tuple:
    """(shape, dtype, weak type) of a leaf; an array's (or a tracer's) from the abstract value it
    holds, read once (a training loop's call passes every parameter and optimizer leaf). With
    `live` (concrete arguments), a deleted `jax.Array` raises `_DeletedLeaf`."""
    if isinstance(leaf, jax.Array):
        if live and leaf.is_deleted():
            raise _DeletedLeaf
        aval = leaf.aval
    else:
        aval = jax.typeof(leaf)
    return aval.shape, aval.dtype, aval.weak_type


def deleted_error(name: str, where: str, leaf) -> MpmdError:
    """The error for a deleted array passed as `where` (`argument 0 ('params')['w1']`)."""
    return MpmdError(
        f"{name}: {where} ({jax.typeof(leaf).str_short()}) is a deleted array: a call that donates "
        f"its inputs consumed it ({DONATING_CALLS}), or it was freed with .delete(). Pass the arrays "
        "that call returned (the new params and opt_state) instead; to keep the inputs alive, use "
        "donate=False (or leave out donate_argnums)."
    )


def signature(
    name: str, fn: Callable, args: Sequence, static_argnums: tuple[int, ...], *, traced: bool = False
) -> Signature:
    """The signature of a call: static values, argument tree, leaf types, JAX's trace config.

    Concrete arguments (not `traced`) are checked on the way: a deleted array (donated to an
    earlier call) raises `MpmdError` naming it, before any device work."""
    static = _normalize(name, "static_argnums", static_argnums, len(args))
    statics = tuple((k, args[k]) for k in sorted(set(static)))
    positions = tuple(k for k in range(len(args)) if k not in static)
    dynamic = tuple(args[k] for k in positions)
    leaves, in_tree = jax.tree.flatten(dynamic)
    try:
        types = tuple(_leaf_type(x, not traced) for x in leaves)
    except _DeletedLeaf:
        bad = next(a for a, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted())
        raise deleted_error(name, _describe_leaf(fn, positions, dynamic, bad), leaves[bad]) from None
    except TypeError as err:
        bad = next(a for a, x in enumerate(leaves) if not _is_typed(x))
        where = _describe_leaf(fn, positions, dynamic, bad)
        raise MpmdError(
            f"{name}: {where} is a {type(leaves[bad]).__name__}, not an array or a number. Pass "
            "non-array values through static_argnums (they are hashed into the cache key)."
        ) from err
    key = (len(args), tuple((k, type(v), v) for k, v in statics), in_tree, types, config_key())
    try:
        hash(key)
    except TypeError as err:
        raise MpmdError(
            f"{name}: static arguments must be hashable (they key the compiled plan, as in jax.jit): {err}"
        ) from err
    return Signature(key, statics, positions, leaves, in_tree, types)


def _is_typed(leaf) -> bool:
    try:
        jax.typeof(leaf)
    except TypeError:
        return False
    return True


@dataclass(frozen=True)
class ArgumentKinds:
    """Flat-leaf indices (over the dynamic arguments) of each kind."""

    argnums: tuple[int, ...]  # the differentiated positions, non-negative, in the order given
    params: tuple[int, ...]
    batch: tuple[int, ...]
    broadcast: tuple[int, ...]
    keys: frozenset  # broadcast leaves that are PRNG keys
    batch_size: int | None


def classify(
    name: str,
    fn: Callable,
    sig: Signature,
    argnums: tuple[int, ...],
    batch_argnums: tuple[int, ...] | None,
    microbatches: int,
) -> ArgumentKinds:
    """Sort the leaves into parameters, batch and broadcast, checking each kind's rules."""
    n_args = len(sig.positions) + len(sig.statics)
    argnums = _normalize(name, "argnums", argnums, n_args)
    static = {k for k, _ in sig.statics}
    if static & set(argnums):
        raise MpmdError(
            f"{name}: argnums={argnums} and static_argnums share {sorted(static & set(argnums))}; "
            "a differentiated argument cannot be static."
        )
    if batch_argnums is None:
        batch_pos = tuple(k for k in sig.positions if k not in argnums)
    else:
        batch_pos = _normalize(name, "batch_argnums", batch_argnums, n_args)
        clash = set(batch_pos) & (set(argnums) | static)
        if clash:
            raise MpmdError(
                f"{name}: batch_argnums={batch_argnums} includes {sorted(clash)}, which "
                "argnums or static_argnums already name; an argument has one kind."
            )
    ranges = dict(zip(sig.positions, sig.ranges()))
    params = tuple(a for k in sorted(set(argnums)) for a in ranges[k])
    batch = tuple(a for k in sorted(set(batch_pos)) for a in ranges[k])
    taken = set(params) | set(batch)
    broadcast = tuple(a for a in range(len(sig.leaves)) if a not in taken)
    for a in params:
        if not jax.dtypes.issubdtype(sig.types[a][1], np.inexact):
            raise MpmdError(
                f"{name}: {sig.describe(fn, a)} is differentiated (argnums) but has dtype {sig.types[a][1]}; "
                "gradients need floating-point parameters. Move integer arrays out of argnums."
            )
    batch_size = None
    for a in batch:
        shape = sig.types[a][0]
        if not shape:
            raise MpmdError(
                f"{name}: {sig.describe(fn, a)} is a batch argument but has shape (): a scalar cannot be split "
                f"into microbatches. Pass batch_argnums= listing only the batched arguments, so this "
                "one is broadcast to every microbatch (a PRNG key is then folded per microbatch), or "
                "make it static with static_argnums."
            )
        if batch_size is None:
            batch_size, first = shape[0], a
        elif shape[0] != batch_size:
            raise MpmdError(
                f"{name}: batch leaves must share one leading (batch) size, but {sig.describe(fn, first)} has "
                f"{batch_size} and {sig.describe(fn, a)} has {shape[0]}. If {sig.describe(fn, a)} is the same for every "
                "example (a mask, a table), pass batch_argnums= naming only the batched arguments "
                "so it is broadcast instead of split."
            )
    if batch_size is not None and batch_size % microbatches:
        raise MpmdError(
            f"{name}: the batch size {batch_size} (leading axis of {sig.describe(fn, first)}) is not divisible by "
            f"schedule.microbatches={microbatches}. Use a batch size that is a multiple of "
            f"{microbatches} or change the number of microbatches."
        )
    keys = frozenset(a for a in broadcast if is_prng_key(*sig.types[a][:2]))
    return ArgumentKinds(argnums, params, batch, broadcast, keys, batch_size)


def traced_avals(sig: Signature, kinds: ArgumentKinds | None, microbatches: int) -> list:
    """Every leaf's abstract value for tracing; batch leaves at microbatch size."""
    avals = [sig.aval(a) for a in range(len(sig.leaves))]
    for a in kinds.batch if kinds is not None else ():
        avals[a] = sig.aval(a, (kinds.batch_size // microbatches, *sig.types[a][0][1:]))
    return avals
