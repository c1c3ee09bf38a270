"""Logical sharding: axis tokens, per-mode rules, and pure spec functions.

A params class names what each array axis means with a token (`EMBED`,
`MLP`, ...) in its `logical_axes()` method; a `Rules` object maps each token
to mesh axes, separately for `"train"` and `"decode"`; the functions here turn
tokens into `PartitionSpec`s for one particular mesh. Layer code never writes
a `PartitionSpec`, so the same layer runs on one device, an SPMD mesh or a
stage-local submesh.

Resolution of one array's tokens, axis by axis from left to right:

* a mesh axis absent from the mesh, or of size 1 in it, is dropped;
* a mesh axis already taken by an earlier axis of the same array is dropped
  (a `PartitionSpec` may use each mesh axis once);
* with a known shape, an axis whose size is not divisible by the product of
  its remaining mesh axes is replicated, and those mesh axes stay free for
  later axes;
* no mesh axes left gives `None`, one gives a plain name, several a tuple.

Params protocol (see `spectrax_core.nn.Linear`): `logical_axes(self)` returns
`{array_field: (token | None, ...)}` with one entry per array axis; sub-module
fields are not listed. A container whose fields hold a stack of identical
sub-modules with a leading layer axis sets the class variable
`stacked_fields = ("layers",)`: every spec found under those fields gains one
leading `None` (stacks of stacks gain one per level). Leaves nobody declares
are replicated: `PartitionSpec()`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import DictKey, GetAttrKey, SequenceKey
from jaxtyping import Array

BATCH = "BATCH"
LENGTH = "LENGTH"
EMBED = "EMBED"
HEAD = "HEAD"
KV_HEAD = "KV_HEAD"
MLP = "MLP"
VOCAB = "VOCAB"
EXPERT = "EXPERT"

TOKENS: tuple[str, ...] = (BATCH, LENGTH, EMBED, HEAD, KV_HEAD, MLP, VOCAB, EXPERT)
MODES: tuple[str, ...] = ("train", "decode")

MeshAxes = tuple[str, ...]
RuleTable = tuple[tuple[str, MeshAxes], ...]
Axes = Sequence[str | None]

_DEFAULT_TRAIN: dict[str, MeshAxes] = {
    BATCH: ("dp", "fsdp"),
    LENGTH: ("sp",),
    EMBED: ("fsdp",),
    HEAD: ("tp",),
    KV_HEAD: ("tp",),
    MLP: ("tp",),
    VOCAB: ("tp",),
    EXPERT: ("ep",),
}

# Decode: weights are not gathered per generated token, so EMBED is not
# sharded over fsdp (the fsdp devices serve as batch parallelism instead); the
# query length is usually 1, so LENGTH is not sharded either.
_DEFAULT_DECODE: dict[str, MeshAxes] = {**_DEFAULT_TRAIN, LENGTH: (), EMBED: ()}


def _mesh_axes_of(token: str, value: Any, mode: str) -> MeshAxes:
    """Normalise one rule value (None, a name, or a sequence of names) to a tuple."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        names = tuple(value)
    except TypeError:
        raise TypeError(
            f"Rules: the {mode!r} rule for {token!r} must be None, a mesh axis name or a "
            f"sequence of mesh axis names; received {value!r}."
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"Rules: the {mode!r} rule for {token!r} must list mesh axis names (str); received {value!r}."
            )
    if len(set(names)) != len(names):
        raise ValueError(
            f"Rules: the {mode!r} rule for {token!r} names a mesh axis twice: {names!r}; "
            "list each mesh axis once."
        )
    return names


def _table_of(table: Any, mode: str) -> RuleTable:
    """Normalise a mapping (or iterable of pairs) token -> mesh axes to a sorted tuple.

    Standard tokens not stated map to `()`, so equal rules compare equal.
    """
    try:
        items = dict(table).items()
    except (TypeError, ValueError):
        raise TypeError(
            f"Rules: {mode}= must be a mapping from token to mesh axes, e.g. "
            f"{{'EMBED': ('fsdp',)}}; received {table!r}."
        ) from None
    for token, _ in items:
        if not isinstance(token, str) or not token:
            raise TypeError(f"Rules: tokens must be non-empty strings; received {token!r} in {mode}=.")
    stated = {token: _mesh_axes_of(token, value, mode) for token, value in items}
    return tuple(sorted({**dict.fromkeys(TOKENS, ()), **stated}.items()))


@dataclasses.dataclass(frozen=True)
class Rules:
    """Token -> mesh axes, per mode; hashable, so it can be a static jit argument.

    `train` and `decode` are mappings `{token: mesh_axes}` (a mesh axis name, a
    sequence of names, or None). A standard token missing from a mode is not
    sharded in that mode. Tokens beyond the eight standard ones may be added
    (a third-party layer's own axis); they become known to `spec`.

    Build with `Rules.default()` and adjust with `replace`, or pass whole
    tables: `Rules(train={...}, decode={...})` / `dataclasses.replace(rules,
    train={...})`.
    """

    train: RuleTable = ()
    decode: RuleTable = ()

    def __post_init__(self):
        for mode in MODES:
            object.__setattr__(self, mode, _table_of(getattr(self, mode), mode))

    @classmethod
    def default(cls) -> "Rules":
        """The default rules (docs/sharding.md lists them)."""
        return cls(train=_DEFAULT_TRAIN, decode=_DEFAULT_DECODE)

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every token these rules know: the standard ones, then any extra ones."""
        extra = {token for mode in MODES for token, _ in getattr(self, mode)} - set(TOKENS)
        return TOKENS + tuple(sorted(extra))

    def table(self, mode: str = "train") -> dict[str, MeshAxes]:
        """The `{token: mesh_axes}` rules of `mode`, with every known token present."""
        _check_mode(mode)
        stated = dict(getattr(self, mode))
        return {token: stated.get(token, ()) for token in self.tokens}

    def mesh_axes(self, token: str, mode: str = "train") -> MeshAxes:
        """The mesh axes `token` maps to in `mode`, before any mesh is considered."""
        table = self.table(mode)
        _check_token(token, table)
        return table[token]

    def replace(self, *, mode: str | None = None, **tokens: Any) -> "Rules":
        """A copy with the given tokens remapped, in `mode` or (by default) in both modes.

        Example: `Rules.default().replace(EMBED=None, mode="train")` keeps weights whole
        over fsdp in training (the batch still splits over it).
        """
        modes = MODES if mode is None else (_check_mode(mode),)
        changes = {m: {**dict(getattr(self, m)), **tokens} for m in modes}
        return dataclasses.replace(self, **changes)


def _check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ValueError(f"sharding: unknown mode {mode!r}; use one of {MODES}.")
    return mode


def _check_token(token: Any, table: Mapping[str, MeshAxes]) -> None:
    if token not in table:
        raise ValueError(
            f"sharding: unknown logical axis token {token!r}; known tokens are "
            f"{tuple(table)} (or None for an unsharded axis). Add new tokens to the Rules."
        )


def _check_axes(axes: Any, what: str) -> tuple[str | None, ...]:
    if isinstance(axes, str):
        raise TypeError(
            f"{what}: axes must be a tuple with one token per array axis, received the "
            f"string {axes!r}; write ({axes!r},)."
        )
    try:
        axes = tuple(axes)
    except TypeError:
        raise TypeError(f"{what}: axes must be a tuple of tokens or None; received {axes!r}.") from None
    for token in axes:
        if token is not None and not isinstance(token, str):
            raise TypeError(f"{what}: each axis must be a token (str) or None; received {axes!r}.")
    return axes


def _mesh_sizes(mesh: Mesh | AbstractMesh | None) -> dict[str, int] | None:
    """Mesh axis sizes; for `mesh=None` those of the active mesh, or None when there is none."""
    if mesh is None:
        get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
        active = get_abstract_mesh() if get_abstract_mesh is not None else None
        if active is None or active.empty:
            return None
        return dict(active.shape)
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise TypeError(
            f"sharding: mesh must be a jax.sharding.Mesh (or AbstractMesh) or None; "
            f"received {type(mesh).__name__}."
        )
    return dict(mesh.shape)


UNKNOWN = ("error", "replicate")


def _token_axes(
    token: str, table: Mapping[str, MeshAxes], sizes: dict[str, int] | None, unknown: str
) -> MeshAxes:
    """The mesh axes of one token: its rule; else the mesh axis of that name; else per `unknown`."""
    if token in table:
        return table[token]
    if sizes is not None and token in sizes:
        return (token,)
    if unknown == "replicate":
        return ()
    mesh_note = f" and the mesh has no axis of that name (its axes: {tuple(sizes)})" if sizes else ""
    raise ValueError(
        f"sharding: unknown logical axis token {token!r}: no rule maps it{mesh_note}; known tokens are "
        f"{tuple(table)} (or None for an unsharded axis). Add a rule for it, or fix the name."
    )


def _resolve(
    axes: tuple[str | None, ...],
    table: Mapping[str, MeshAxes],
    sizes: dict[str, int] | None,
    shape: tuple[int, ...] | None,
    unknown: str = "error",
) -> PartitionSpec:
    if unknown not in UNKNOWN:
        raise ValueError(f"sharding: unknown={unknown!r}; use one of {UNKNOWN}.")
    used: set[str] = set()
    entries: list[str | tuple[str, ...] | None] = []
    for i, token in enumerate(axes):
        if token is None:
            entries.append(None)
            continue
        kept = tuple(
            name
            for name in _token_axes(token, table, sizes, unknown)
            if name not in used and (sizes is None or sizes.get(name, 1) > 1)
        )
        if kept and shape is not None and sizes is not None:
            if shape[i] % math.prod(sizes[name] for name in kept):
                kept = ()
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def spec(
    axes: Axes,
    rules: Rules,
    mode: str = "train",
    mesh: Mesh | AbstractMesh | None = None,
    *,
    shape: Sequence[int] | None = None,
    unknown: str = "error",
) -> PartitionSpec:
    """The `PartitionSpec` of an array whose axes mean `axes` (tokens or None).

    `mesh=None` resolves against the active mesh (`jax.set_mesh`), or keeps
    every mesh axis of the rules when none is active. With `shape` (and a
    known mesh), an axis not divisible by its mesh axes' product is replicated.
    A token no rule names but the mesh has an axis of that name means that mesh
    axis; any other unknown token raises (`unknown="error"`) or is left
    unsharded (`unknown="replicate"`).
    """
    axes = _check_axes(axes, "spec")
    table = rules.table(mode)
    if shape is not None:
        shape = tuple(shape)
        if len(shape) != len(axes):
            raise ValueError(
                f"spec: axes {axes} name {len(axes)} axes but shape {shape} has {len(shape)}; "
                "give one token (or None) per array axis."
            )
    return _resolve(axes, table, _mesh_sizes(mesh), shape, unknown)


def _declared_table(node: Any, cache: dict[int, dict[str, tuple]]) -> dict[str, tuple]:
    """`node.logical_axes()`, checked; `{}` for nodes that declare nothing."""
    if id(node) in cache:
        return cache[id(node)]
    declare = getattr(node, "logical_axes", None)
    table: dict[str, tuple] = {}
    if callable(declare):
        owner = type(node).__name__
        declared = declare()
        if not isinstance(declared, Mapping):
            raise TypeError(
                f"{owner}.logical_axes() must return a dict {{field: axes}}; received "
                f"{type(declared).__name__}."
            )
        for field, axes in declared.items():
            if not hasattr(node, field):
                raise ValueError(
                    f"{owner}.logical_axes() names field {field!r}, which {owner} does not have."
                )
            table[field] = _check_axes(axes, f"{owner}.logical_axes()[{field!r}]")
    cache[id(node)] = table
    return table


def _declared_axes(
    root: Any, path: tuple, cache: dict[int, dict[str, tuple]]
) -> tuple[tuple[str | None, ...], str] | None:
    """The logical axes declared for the leaf at `path`, and the field that declares them.

    Walks from `root` along `path`; a step into a `stacked_fields` field adds
    one leading None. Returns None when no ancestor declares the leaf.
    """
    node, depth = root, 0
    for i, key in enumerate(path):
        if isinstance(key, GetAttrKey):
            table = _declared_table(node, cache)
            if key.name in table:
                where = f"{type(node).__name__}.{key.name}"
                if i != len(path) - 1:
                    raise ValueError(
                        f"{where}: logical_axes() declares axes for a field that is not an "
                        "array; list only array fields (sub-modules declare their own)."
                    )
                return (None,) * depth + table[key.name], where
            if key.name in getattr(type(node), "stacked_fields", ()):
                depth += 1
            node = getattr(node, key.name)
        elif isinstance(key, SequenceKey):
            node = node[key.idx]
        elif isinstance(key, DictKey):
            node = node[key.key]
        else:
            return None
    return None


def param_specs(
    params: Any,
    rules: Rules,
    mode: str = "train",
    mesh: Mesh | AbstractMesh | None = None,
    *,
    unknown: str = "error",
) -> Any:
    """A pytree of `PartitionSpec` with the structure of `params`.

    Each array gets the spec of its declared logical axes (see the module
    docstring); undeclared leaves get `PartitionSpec()`; None fields stay
    None. With a known mesh (given or active), axes that do not divide evenly
    are replicated.
    """
    table = rules.table(mode)
    sizes = _mesh_sizes(mesh)
    cache: dict[int, dict[str, tuple]] = {}

    def leaf_spec(path: tuple, leaf: Any) -> PartitionSpec:
        found = _declared_axes(params, path, cache)
        if found is None:
            return PartitionSpec()
        axes, where = found
        shape = tuple(getattr(leaf, "shape", ()))
        if len(axes) != len(shape):
            raise ValueError(
                f"{where}: logical axes {axes} name {len(axes)} axes but the array has shape "
                f"{shape}; declare one token (or None) per axis (stacked fields add a leading "
                "None automatically)."
            )
        return _resolve(axes, table, sizes, shape, unknown)

    return jax.tree_util.tree_map_with_path(leaf_spec, params)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def named_shardings(params: Any, rules: Rules, mesh: Mesh, mode: str = "train") -> Any:
    """A pytree of `NamedSharding` over `mesh` with the structure of `params`.

    For `jax.device_put(params, ...)` and `jax.jit(in_shardings=/out_shardings=)`.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"named_shardings: mesh must be a concrete jax.sharding.Mesh; received {type(mesh).__name__}."
        )
    specs = param_specs(params, rules, mode, mesh)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def constrain(
    x: Array,
    axes: Axes,
    rules: Rules,
    mesh: Mesh | AbstractMesh | None,
    mode: str = "train",
    *,
    unknown: str = "error",
) -> Array:
    """`jax.lax.with_sharding_constraint` of `x` to the spec of `axes` on `mesh`.

    `mesh=None` uses the active mesh (`jax.set_mesh`). Axes that do not divide
    evenly are left replicated.
    """
    axes = _check_axes(axes, "constrain")
    if len(axes) != x.ndim:
        raise ValueError(
            f"constrain: axes {axes} name {len(axes)} axes but x has shape {tuple(x.shape)}; "
            "give one token (or None) per axis of x."
        )
    sizes = _mesh_sizes(mesh)
    if sizes is None:
        raise ValueError(
            "constrain: mesh=None needs an active mesh; pass a jax.sharding.Mesh or call "
            "inside `with jax.set_mesh(mesh):`."
        )
    resolved = _resolve(axes, rules.table(mode), sizes, tuple(x.shape), unknown)
    target: NamedSharding | PartitionSpec = resolved if mesh is None else NamedSharding(mesh, resolved)
    return jax.lax.with_sharding_constraint(x, target)


__all__ = [
    "BATCH",
    "LENGTH",
    "EMBED",
    "HEAD",
    "KV_HEAD",
    "MLP",
    "VOCAB",
    "EXPERT",
    "TOKENS",
    "MODES",
    "Rules",
    "spec",
    "param_specs",
    "named_shardings",
    "constrain",
]
