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

from .._optim import StagedOptState, remote_array
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


def _unstack_all(xs):
    return tuple(tuple(x) for x in xs)


@jax.jit
def _stack_all(groups):
    return tuple(jnp.stack(g) for g in groups)


def _device_key(x) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in x.sharding.device_set))


def unstack_layers(xs: list) -> list[tuple]:
    """Each stacked array split into its layers, computed where it lives (one program per device set).

    A layer keeps its stack's sharding without the layer axis on every process: where another
    process holds the stack, its layers are global arrays without local shards here.
    """
    out: list = [None] * len(xs)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, x in enumerate(xs):
        groups.setdefault(_device_key(x), []).append(k)
    for idx in groups.values():
        places = tuple(
            (_layer_sharding(xs[k].sharding, "a stacked block leaf", "save"),) * xs[k].shape[0] for k in idx
        )
        if not xs[idx[0]].is_fully_addressable:
            for k, layer in zip(idx, places):
                out[k] = tuple(remote_array(_struct(xs[k].shape[1:], xs[k].dtype, sh)) for sh in layer)
            continue
        unstack = jax.jit(_unstack_all, out_shardings=places)
        for k, layers in zip(idx, unstack(tuple(xs[k] for k in idx))):
            out[k] = layers
    return out


def stack_layers(requests: list[tuple[list, Any]]) -> list:
    """`(layers, sharding)` pairs stacked on the layers' devices (one program per device set); a
    stack another process holds is a global array without local shards here."""
    out: list = [None] * len(requests)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, (layers, _) in enumerate(requests):
        groups.setdefault(_device_key(layers[0]), []).append(k)
    for idx in groups.values():
        stacked = [
            _struct((len(requests[k][0]), *requests[k][0][0].shape), requests[k][0][0].dtype, None)
            for k in idx
        ]
        if requests[idx[0]][0][0].is_fully_addressable:
            stacked = _stack_all(tuple(tuple(requests[k][0]) for k in idx))
        for k, x in zip(idx, stacked):
            out[k] = _placed(x, requests[k][1])
    return out


def _struct(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def _placed(x, sharding):
    """`x` on `sharding`; a global array without local shards where another process holds `x` or
    `sharding`'s devices."""
    if isinstance(x, jax.ShapeDtypeStruct) or not (x.is_fully_addressable and sharding.is_fully_addressable):
        return remote_array(_struct(x.shape, x.dtype, sharding))
    return jax.device_put(x, sharding)


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


def _layer_sharding(sharding, path: str, where: str = "restore"):
    """The sharding of one layer of a stacked leaf placed with `sharding` (the layer axis dropped)."""
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        if spec and spec[0] is not None:
            raise CheckpointError(
                f"{where}: {path} is sharded over its layer axis ({sharding.spec}); stacked block leaves "
                "must keep that axis unsharded. Shard another axis instead."
            )
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]), memory_kind=sharding.memory_kind)
    raise CheckpointError(
        f"{where}: {path} has a {type(sharding).__name__}; stacked block leaves need a NamedSharding "
        "or a single device."
    )
