"""Layout-independent names for the arrays of a checkpoint.

A pipeline run holds a model's blocks as a `StagedStack` (one `BlockStack`
per stage, each on its rank); a single-device or SPMD run holds one
`BlockStack`. A checkpoint names every array independently of that layout: a
leaf of stacked blocks is saved as one array per layer, named by the layer's
index in the whole model (`blocks.layers.attn.q.weight[3]`), every other leaf
by its path (`embed.table`). A layer's array is a slice taken on the devices
that hold its stage, so saving gathers nothing; restoring reads the layers a
target stage needs straight onto that stage's devices and stacks them there.

A `StagedOptState` (one optax state per device group, each built over the
group's list of parameter leaves) is named the same way: a per-parameter
entry as `<path in the optax state>/<parameter's name>` (split per layer like
its parameter), a shared entry (a step count) as `<path in the optax state>`,
taken from the first group and copied to every group on restore.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.tree_util import keystr, tree_flatten_with_path

from spectrax_core.nn import BlockStack

from .._optim import StagedOptState
from .._stages import StagedStack
from ..errors import MpmdError


class CheckpointError(MpmdError):
    """A checkpoint cannot be written or read as asked (missing, or not matching the target)."""


@dataclass(frozen=True)
class Leaf:
    """One leaf of a tree: its path there, its checkpoint names, whether it holds stacked layers."""

    path: str
    names: tuple[str, ...]
    stacked: bool


def _is_stack(x) -> bool:
    return isinstance(x, (BlockStack, StagedStack))


def leaves_of(tree) -> list[Leaf]:
    """The checkpoint names of `tree`'s leaves, in `jax.tree.leaves` order."""
    out = []
    for path, node in tree_flatten_with_path(tree, is_leaf=_is_stack)[0]:
        where = keystr(path)
        if not _is_stack(node):
            out.append(Leaf(where, (where.lstrip("."),), False))
            continue
        parts = [(".layers", node.layers)] if isinstance(node, BlockStack) else None
        if parts is None:
            parts = [(f".parts[{k}].layers", p.layers) for k, p in enumerate(node.parts)]
        start = 0
        for sub, layers in parts:
            flat = tree_flatten_with_path(layers)[0]
            for lpath, x in flat:
                base = f"{where}.layers{keystr(lpath)}".lstrip(".")
                names = tuple(f"{base}[{start + i}]" for i in range(x.shape[0]))
                out.append(Leaf(f"{where}{sub}{keystr(lpath)}", names, True))
            start += flat[0][1].shape[0] if flat else 0
    return out


@jax.jit
def _unstack_all(xs):
    return tuple(tuple(x) for x in xs)


@jax.jit
def _stack_all(groups):
    return tuple(jnp.stack(g) for g in groups)


def _device_key(x) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in x.sharding.device_set))


def unstack_layers(xs: list) -> list[tuple]:
    """Each stacked array split into its layers, computed where it lives (one program per device set)."""
    out: list = [None] * len(xs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, x in enumerate(xs):
        groups.setdefault(_device_key(x), []).append(k)
    for idx in groups.values():
        for k, layers in zip(idx, _unstack_all(tuple(xs[k] for k in idx))):
            out[k] = layers
    return out


def stack_layers(requests: list[tuple[list, Any]]) -> list:
    """`(layers, sharding)` pairs stacked on the layers' devices (one program per device set)."""
    out: list = [None] * len(requests)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, (layers, _) in enumerate(requests):
        groups.setdefault(_device_key(layers[0]), []).append(k)
    for idx in groups.values():
        stacked = _stack_all(tuple(tuple(requests[k][0]) for k in idx))
        for k, x in zip(idx, stacked):
            out[k] = jax.device_put(x, requests[k][1])
    return out


def _is_param_list(n: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and len(x) == n


def _opt_entries(idx: tuple[int, ...], state, params: list[Leaf], shapes: list[tuple]):
    """`(name, leaf, per_layer, param index)` for every array of one group's optax state.

    `per_layer` says the entry follows a stacked parameter layer by layer.
    Shared entries (not inside the per-parameter lists) have param index None.
    """
    out = []
    for path, node in tree_flatten_with_path(state, is_leaf=_is_param_list(len(idx)))[0]:
        where = keystr(path)
        if not _is_param_list(len(idx))(node):
            out.append((where, node, False, None))
            continue
        for i, elem in enumerate(node):
            k = idx[i]
            for sub, x in tree_flatten_with_path(elem)[0]:
                stacked = params[k].stacked and len(x.shape) > 0 and x.shape[0] == shapes[k][0]
                if params[k].stacked and not stacked:
                    raise CheckpointError(
                        f"optimizer state {where}{keystr(sub)} of parameter {params[k].path} has shape "
                        f"{tuple(x.shape)}, without its stacked parameter's leading layer axis "
                        f"({shapes[k][0]}), so it cannot be saved per layer. Use an optax transformation "
                        "whose per-parameter state keeps that axis (element-wise ones such as adam and sgd do)."
                    )
                names = tuple(f"{where}{keystr(sub)}/{n}" for n in params[k].names)
                out.append((names, x, stacked, k))
    return out


def save_arrays(params, opt_state=None) -> tuple[dict, dict, dict]:
    """The arrays to write, by name: `(params, opt_state, description)`.

    Each array is a leaf of the caller's trees or a layer of one, sliced on
    the leaf's own devices. The description records every name's shape and
    dtype (and the kind of optimizer state) for checks before a restore.
    """
    p_leaves = jax.tree.leaves(params)
    p_names = leaves_of(params)
    entries: list[tuple[str, tuple[str, ...], bool, Any]] = []  # (item, names, stacked, array)
    for leaf, x in zip(p_names, p_leaves):
        entries.append(("params", leaf.names, leaf.stacked, _as_array(x, leaf.path)))
    kind = None
    if opt_state is not None and isinstance(opt_state, StagedOptState):
        kind = "staged"
        shapes = [tuple(jnp.shape(x)) for x in p_leaves]
        for g, (idx, state) in enumerate(zip(opt_state.groups, opt_state.states)):
            for names, x, stacked, k in _opt_entries(idx, state, p_names, shapes):
                if k is not None or g == 0:
                    entries.append(("opt_state", (names,) if k is None else names, stacked, x))
    elif opt_state is not None:
        kind = "tree"
        for leaf, x in zip(leaves_of(opt_state), jax.tree.leaves(opt_state)):
            entries.append(("opt_state", leaf.names, leaf.stacked, _as_array(x, leaf.path)))
    keys = {}
    for k, (item, names, stacked, x) in enumerate(entries):
        if _is_key(x.dtype):
            if stacked:
                raise CheckpointError(f"save: stacked PRNG keys ({names[0]}) cannot be split per layer.")
            keys[item, names[0]] = [list(x.shape), str(x.dtype), str(jax.random.key_impl(x))]
            entries[k] = (item, names, stacked, jax.random.key_data(x))
    stacked_at = [k for k, e in enumerate(entries) if e[2]]
    layers = dict(zip(stacked_at, unstack_layers([entries[k][3] for k in stacked_at])))
    out: dict[str, dict] = {"params": {}, "opt_state": {}}
    for k, (item, names, stacked, x) in enumerate(entries):
        out[item].update(zip(names, layers[k] if stacked else [x]))

    def describe(item: str) -> dict:  # [shape, dtype] (+ [impl, data shape, data dtype] for keys)
        return {k: keys.get((item, k), []) + _describe(v) for k, v in out[item].items()}

    desc = {"params": describe("params"), "opt_state": describe("opt_state"), "opt_kind": kind}
    return out["params"], out["opt_state"], desc


def _as_array(x, path: str):
    if isinstance(x, jax.Array):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jnp.asarray(x)
    raise CheckpointError(
        f"checkpoint: leaf {path or '(root)'} is a {type(x).__name__}, not an array; only arrays are "
        "saved. Put plain Python values in extra= (JSON) instead."
    )


def _describe(x) -> list:
    return [list(x.shape), _dtype_name(x.dtype)]


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _dtype_name(dtype) -> str:
    """A dtype as text: `float32`, or `key<fry>` for typed PRNG keys."""
    return str(dtype) if _is_key(dtype) else jnp.dtype(dtype).name


# -- restoring ---------------------------------------------------------------------------


def sharding_of(x):
    """Where a target leaf goes: its sharding, or the default device for one without."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return SingleDeviceSharding(jax.devices()[0])
    return sharding


def _layer_sharding(sharding, path: str):
    """The sharding of one layer of a stacked leaf placed with `sharding` (the layer axis dropped)."""
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            raise CheckpointError(
                f"restore: {path} is sharded over its layer axis ({sharding.spec}); stacked block leaves "
                "must keep that axis unsharded. Shard another axis instead."
            )
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)
    raise CheckpointError(
        f"restore: {path} has a {type(sharding).__name__}; stacked block leaves need a NamedSharding "
        "or a single device."
    )


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
    for idx in groups_t:
        abstract = jax.eval_shape(
            optimizer.tx.init, [jax.ShapeDtypeStruct(leaves[k].shape, leaves[k].dtype) for k in idx]
        )
        home = _replicated(places[idx[0]])
        entries = []
        for names, x, stacked, k in _opt_entries(idx, abstract, p_names, shapes):
            if k is None:
                target.add(names, x.shape, x.dtype, _replicated(places[0]), names)
                entries.append((names, home, False, None))
                continue
            same = tuple(x.shape) == shapes[k]
            sh = places[k] if same else _replicated(places[k])
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
                values.append(jax.device_put(got[names], sh))
            else:
                values.append(built[j] if is_stacked else got[names[0]])
        states, start = [], 0
        for treedef, entries in plans:
            states.append(treedef.unflatten(values[start : start + len(entries)]))
            start += len(entries)
        return StagedOptState(groups_t, tuple(states))

    return target, rebuild
