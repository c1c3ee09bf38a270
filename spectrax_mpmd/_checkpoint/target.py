"""Restore targets: what a restore reads, onto which devices, and how it rebuilds the trees.

A target names the arrays a restore wants by their layout-independent names
(`layout`), each with the sharding of the target leaf (a stacked leaf's layers
with the stack's sharding without the layer axis), checks them against what the
checkpoint holds before reading anything, and rebuilds the caller's trees from
the arrays read: layers stacked again on their stage's devices, a
`StagedOptState` grouped as `StagedOptimizer.init` would group the target
parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from .._mesh import default_device
from .._optim import StagedOptState, state_shardings
from .layout import (
    CheckpointError,
    Leaf,
    _dtype_name,
    _is_key,
    _layer_sharding,
    _opt_entries,
    _placed,
    leaves_of,
    stack_layers,
)


def sharding_of(x):
    """Where a target leaf goes: its sharding, or the default device for one without."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return SingleDeviceSharding(default_device())
    return sharding


def _replicated(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    return SingleDeviceSharding(next(iter(sorted(sharding.device_set, key=lambda d: d.id))))


class Target:
    """What a restore reads (`want`: name -> abstract array with its sharding) and how it rebuilds trees."""

    def __init__(self):
        self.want: dict[str, jax.ShapeDtypeStruct] = {}
        self.where: dict[str, str] = {}  # name -> the target leaf's path, for messages
        self.keys: dict[str, str] = {}  # name -> PRNG implementation of a typed-key leaf

    def add(self, name: str, shape, dtype, sharding, path: str) -> None:
        self.want[name] = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
        self.where[name] = path

    def add_leaf(self, leaf: Leaf, x, sharding) -> None:
        if leaf.stacked:
            layer = _layer_sharding(sharding, leaf.path)
            for n in leaf.names:
                self.add(n, x.shape[1:], x.dtype, layer, leaf.path)
        else:
            self.add(leaf.names[0], x.shape, x.dtype, sharding, leaf.path)

    def check(self, saved: dict, what: str) -> None:
        """Raise naming the first target leaf whose name, shape or dtype the checkpoint does not hold."""
        for name, sds in self.want.items():
            path = self.where[name] or "(root)"
            if name not in saved:
                raise CheckpointError(
                    f"restore: the target's {what} leaf {path} (saved name {name!r}) is not in the "
                    f"checkpoint; it holds {what} {_preview(saved)}. Restore into a tree of the "
                    "structure that was saved."
                )
            shape, dtype, *stored = saved[name]
            if tuple(shape) != tuple(sds.shape) or dtype != _dtype_name(sds.dtype):
                raise CheckpointError(
                    f"restore: the target's {what} leaf {path} (saved name {name!r}) is "
                    f"{_dtype_name(sds.dtype)}{list(sds.shape)} but the checkpoint holds "
                    f"{dtype}{list(shape)}. Build the target with the saved model's sizes and dtypes."
                )
            if _is_key(sds.dtype):  # saved as its raw key data
                impl, data_shape, data_dtype = stored
                self.keys[name] = impl
                self.want[name] = jax.ShapeDtypeStruct(tuple(data_shape), data_dtype, sharding=sds.sharding)
        extra = [n for n in saved if n not in self.want]
        if extra:
            raise CheckpointError(
                f"restore: the checkpoint's {what} leaf {extra[0]!r} has no place in the target "
                f"({len(extra)} such leaves). Restore into a tree of the structure that was saved."
            )

    def finish(self, got: dict) -> dict:
        """The arrays read, typed PRNG keys rebuilt from their data."""
        for name, impl in self.keys.items():
            got[name] = jax.random.wrap_key_data(got[name], impl=impl)
        return got


def _preview(names) -> str:
    names = list(names)
    return repr(names[:6])[:-1] + (", ...]" if len(names) > 6 else "]")


def tree_target(like, shardings=None) -> tuple[Target, Callable[[dict], Any]]:
    """The arrays a restore of a tree shaped like `like` reads, and the function that rebuilds the tree."""
    leaves, treedef = jax.tree.flatten(like)
    names = leaves_of(like)
    places = [sharding_of(x) for x in leaves] if shardings is None else _shardings_for(like, shardings)
    target = Target()
    for leaf, x, sh in zip(names, leaves, places):
        target.add_leaf(leaf, x, sh)

    def rebuild(got: dict):
        stacked = [k for k, leaf in enumerate(names) if leaf.stacked]
        built = stack_layers([([got[n] for n in names[k].names], places[k]) for k in stacked])
        values = [None if leaf.stacked else got[leaf.names[0]] for leaf in names]
        for k, x in zip(stacked, built):
            values[k] = x
        return treedef.unflatten(values)

    return target, rebuild


def _shardings_for(like, shardings) -> list:
    try:
        return jax.tree.structure(like).flatten_up_to(shardings)
    except (ValueError, TypeError) as err:
        raise CheckpointError(
            "restore: shardings= must have the structure of like= (one sharding per leaf), e.g. "
            f"mp.owner_shardings(step, params, *batch): {err}"
        ) from err


def staged_opt_target(optimizer, like, shardings=None) -> tuple[Target, Callable[[dict], Any]]:
    """The arrays of a `StagedOptState` for parameters placed as `like`, and its rebuild function.

    Groups follow the parameters' devices (as `StagedOptimizer.init` groups
    them); each group's state structure is `optimizer.tx.init` evaluated
    abstractly, so nothing is allocated before the restore.
    """
    leaves = jax.tree.leaves(like)
    p_names = leaves_of(like)
    places = [sharding_of(x) for x in leaves] if shardings is None else _shardings_for(like, shardings)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, sh in enumerate(places):
        groups.setdefault(tuple(sorted(d.id for d in sh.device_set)), []).append(k)
    groups_t = tuple(tuple(v) for v in groups.values())
    shapes = [tuple(x.shape) for x in leaves]
    target = Target()
    plans = []
    # a shared entry (a step count) is read once per process, onto a group this process holds
    shared = next((sh for sh in places if sh.is_fully_addressable), places[0])
    for idx in groups_t:
        abstract = jax.eval_shape(
            optimizer.tx.init, [jax.ShapeDtypeStruct(leaves[k].shape, leaves[k].dtype) for k in idx]
        )
        placed = state_shardings(abstract, [places[k] for k in idx], [shapes[k] for k in idx])
        entries = []
        found = _opt_entries(idx, abstract, p_names, shapes)
        for (names, x, stacked, k), sh in zip(found, jax.tree.leaves(placed)):  # as StagedOptimizer.init
            if k is None:
                target.add(names, x.shape, x.dtype, _replicated(shared), names)
                entries.append((names, sh, False, None))
                continue
            path = f"optimizer state {names[0].split('/', 1)[0]} of {p_names[k].path}"
            if stacked:
                layer = _layer_sharding(sh, p_names[k].path)
                for n in names:
                    target.add(n, x.shape[1:], x.dtype, layer, path)
            else:
                target.add(names[0], x.shape, x.dtype, sh, path)
            entries.append((names, sh, stacked, k))
        plans.append((jax.tree.structure(abstract), entries))

    def rebuild(got: dict):
        flat = [e for _, entries in plans for e in entries]
        stacked = [j for j, e in enumerate(flat) if e[2]]
        built = dict(
            zip(stacked, stack_layers([([got[n] for n in flat[j][0]], flat[j][1]) for j in stacked]))
        )
        values = []
        for j, (names, sh, is_stacked, k) in enumerate(flat):
            if k is None:
                values.append(_placed(got[names], sh))
            else:
                values.append(built[j] if is_stacked else got[names[0]])
        states, start = [], 0
        for treedef, entries in plans:
            states.append(treedef.unflatten(values[start : start + len(entries)]))
            start += len(entries)
        return StagedOptState(groups_t, tuple(states))

    return target, rebuild
