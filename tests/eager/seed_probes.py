"""Behaviour probes of the seed library's names, library-agnostic: each takes the library's
modules (`lib.spx`, `lib.nn`, ...) and returns a JSON-able summary (return shapes and types,
iteration order, attribute types). `python seed_probes.py` with the seed library installed
(imported as `spectrax`) writes `data/seed_probes.json`; `test_migrating_table.py` runs the
same probes here and compares them for every row stated *same*."""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

DATA = Path(__file__).parent / "data" / "seed_probes.json"
X = jnp.asarray(np.sin(np.arange(24) * 0.7).reshape(2, 3, 4), jnp.float32)
EXCEPTIONS = (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError)


def library(top: str) -> types.SimpleNamespace:
    """The library's modules under the seed's names."""
    names = ("nn", "sharding", "init", "functional", "inspect", "hooks", "runtime")
    spx = importlib.import_module(top)
    return types.SimpleNamespace(spx=spx, **{n: importlib.import_module(f"{top}.{n}") for n in names})


def generic(obj) -> dict:
    """What any name is: its kind, and for an exception class the builtin errors it is."""
    if inspect.ismodule(obj):
        return {"kind": "module"}
    if inspect.isclass(obj):
        out = {"kind": "class"}
        if issubclass(obj, BaseException):
            out["is"] = [e.__name__ for e in EXCEPTIONS if issubclass(obj, e)]
        return out
    if callable(obj):
        return {"kind": "callable"}
    if isinstance(obj, (tuple, list, str, int, float, bool)) or obj is None:
        return {"kind": "value", "value": json.loads(json.dumps(obj))}
    return {"kind": "value"}


def _out(y) -> list:
    """Shapes and dtypes of a result's leaves, in order."""
    return [[list(a.shape), str(a.dtype)] for a in jax.tree.leaves(y)]


def _layer(make, *inputs):
    def probe(lib):
        layer = make(lib)
        return _out(layer(*inputs))

    return probe


def _r(lib):
    return lib.spx.Rngs(0)


IMG1, IMG2, IMG3 = jnp.ones((2, 8, 3)), jnp.ones((2, 6, 6, 3)), jnp.ones((1, 4, 4, 4, 2))

NN = {
    "GELU": _layer(lambda lib: lib.nn.GELU(), X),
    "AdaptiveAvgPool1d": _layer(lambda lib: lib.nn.AdaptiveAvgPool1d(2), IMG1),
    "AdaptiveAvgPool2d": _layer(lambda lib: lib.nn.AdaptiveAvgPool2d((2, 3)), IMG2),
    "AdaptiveAvgPool3d": _layer(lambda lib: lib.nn.AdaptiveAvgPool3d(2), IMG3),
    "AvgPool1d": _layer(lambda lib: lib.nn.AvgPool1d(2), IMG1),
    "AvgPool2d": _layer(lambda lib: lib.nn.AvgPool2d(2, stride=2), IMG2),
    "AvgPool3d": _layer(lambda lib: lib.nn.AvgPool3d(2), IMG3),
    "MaxPool1d": _layer(lambda lib: lib.nn.MaxPool1d(2), IMG1),
    "MaxPool2d": _layer(lambda lib: lib.nn.MaxPool2d(2, stride=2), IMG2),
    "MaxPool3d": _layer(lambda lib: lib.nn.MaxPool3d(2), IMG3),
    "BatchNorm1d": _layer(lambda lib: lib.nn.BatchNorm1d(4).eval(), X),
    "BatchNorm2d": _layer(lambda lib: lib.nn.BatchNorm2d(3).eval(), IMG2),
    "Bilinear": _layer(lambda lib: lib.nn.Bilinear(4, 4, 5, rngs=_r(lib)), X, X),
    "CausalSelfAttention": _layer(lambda lib: lib.nn.CausalSelfAttention(4, 2, rngs=_r(lib)), X),
    "Conv": _layer(lambda lib: lib.nn.Conv(3, 5, (3, 3), rngs=_r(lib)), IMG2),
    "Conv1d": _layer(lambda lib: lib.nn.Conv1d(3, 5, 3, rngs=_r(lib)), IMG1),
    "Conv2d": _layer(lambda lib: lib.nn.Conv2d(3, 5, 3, stride=2, padding="SAME", rngs=_r(lib)), IMG2),
    "Conv3d": _layer(lambda lib: lib.nn.Conv3d(2, 3, 2, rngs=_r(lib)), IMG3),
    "ConvTranspose1d": _layer(lambda lib: lib.nn.ConvTranspose1d(3, 2, 3, rngs=_r(lib)), IMG1),
    "ConvTranspose2d": _layer(lambda lib: lib.nn.ConvTranspose2d(3, 2, 2, stride=2, rngs=_r(lib)), IMG2),
    "ConvTranspose3d": _layer(lambda lib: lib.nn.ConvTranspose3d(2, 3, 2, rngs=_r(lib)), IMG3),
    "DenseGeneral": _layer(lambda lib: lib.nn.DenseGeneral((2, 3), rngs=_r(lib), in_shape=(4,)), X),
    "Dropout": _layer(lambda lib: lib.nn.Dropout(0.5, rngs=_r(lib)).eval(), X),
    "Embed": _layer(lambda lib: lib.nn.Embed(10, 4, rngs=_r(lib)), jnp.asarray([[1, 2, 3]])),
    "Fp8Linear": _layer(lambda lib: lib.nn.Fp8Linear(4, 3, rngs=_r(lib)), X),
    "GroupNorm": _layer(lambda lib: lib.nn.GroupNorm(2, 4), X),
    "Identity": _layer(lambda lib: lib.nn.Identity(), X),
    "LayerNorm": _layer(lambda lib: lib.nn.LayerNorm(4), X),
    "Linear": _layer(lambda lib: lib.nn.Linear(4, 6, rngs=_r(lib)), X),
    "LoRA": _layer(lambda lib: lib.nn.LoRA(4, 2, 5, rngs=_r(lib)), X),
    "LoRALinear": _layer(lambda lib: lib.nn.LoRALinear(4, 5, rank=2, rngs=_r(lib)), X),
    "MLPBlock": _layer(lambda lib: lib.nn.MLPBlock(4, 8, rngs=_r(lib)), X),
    "MultiheadAttention": _layer(lambda lib: lib.nn.MultiheadAttention(4, 2, rngs=_r(lib)), X),
    "RMSNorm": _layer(lambda lib: lib.nn.RMSNorm(4), X),
    "ReLU": _layer(lambda lib: lib.nn.ReLU(), X),
    "SiLU": _layer(lambda lib: lib.nn.SiLU(), X),
    "Sigmoid": _layer(lambda lib: lib.nn.Sigmoid(), X),
    "Tanh": _layer(lambda lib: lib.nn.Tanh(), X),
    "Sequential": _layer(lambda lib: lib.nn.Sequential(lib.nn.Linear(4, 2, rngs=_r(lib)), lib.nn.ReLU()), X),
    "LSTMCell": lambda lib: _out(
        lib.nn.LSTMCell(4, 3, rngs=_r(lib))((jnp.zeros((2, 3)), jnp.zeros((2, 3))), X[:, 0])
    ),
    "GRUCell": lambda lib: _out(lib.nn.GRUCell(4, 3, rngs=_r(lib))(jnp.zeros((2, 3)), X[:, 0])),
    "SimpleRNNCell": lambda lib: _out(lib.nn.SimpleRNNCell(4, 3, rngs=_r(lib))(jnp.zeros((2, 3)), X[:, 0])),
    "ModuleList": lambda lib: [type(m).__name__ for m in lib.nn.ModuleList([lib.nn.ReLU(), lib.nn.Tanh()])],
    "ModuleDict": lambda lib: sorted(lib.nn.ModuleDict({"b": lib.nn.ReLU(), "a": lib.nn.Tanh()}).keys()),
    "wrap_lora": lambda lib: [
        type(m := lib.nn.wrap_lora(lib.nn.Linear(4, 5, rngs=_r(lib)), 2, rngs=_r(lib))).__name__,
        list(m.lora_a.value.shape),
        list(m.lora_b.value.shape),
        _out(m(X)),
    ],
}


def _activation(name, lib):
    return np.asarray(getattr(lib.functional, name)(X)).round(5).ravel()[:6].tolist()


def _initializer(name, lib):
    return _out(getattr(lib.init, name)()(jax.random.key(0), (3, 4), jnp.float32))


def _constant_initializer(name, lib):
    return np.asarray(getattr(lib.init, name)(jax.random.key(0), (2, 3))).tolist()


ACTIVATIONS = "celu elu gelu hard_sigmoid hard_silu hard_swish hard_tanh leaky_relu log_sigmoid"
ACTIVATIONS += " log_softmax mish relu selu sigmoid silu soft_sign softmax tanh"
INITIALIZERS = "kaiming_normal kaiming_uniform normal orthogonal truncated_normal uniform xavier_normal"
INITIALIZERS += " xavier_uniform"
FUNCTIONAL = {name: functools.partial(_activation, name) for name in ACTIVATIONS.split()}
INIT = {name: functools.partial(_initializer, name) for name in INITIALIZERS.split()}
INIT.update({name: functools.partial(_constant_initializer, name) for name in ("ones", "zeros")})


def _net(lib):
    """A two-Linear model (`enc` then `dec`), of a class defined at module level (the seed library
    finds a module's class by its qualified name)."""
    spx, nn = lib.spx, lib.nn
    name = f"Net_{spx.__name__}"
    if name not in globals():

        def __init__(self):
            spx.Module.__init__(self)
            self.enc = nn.Linear(4, 3, rngs=spx.Rngs(0))
            self.dec = nn.Linear(3, 2, rngs=spx.Rngs(1))

        def forward(self, x):
            return self.dec(self.enc(x))

        cls = type(spx.Module)(
            name, (spx.Module,), {"__init__": __init__, "forward": forward, "__module__": __name__}
        )
        cls.__qualname__ = name
        globals()[name] = cls
    return globals()[name]()


def _state_summary(state) -> dict:
    items = list(state.items())
    return {
        "type": type(state).__name__,
        "item_len": sorted({len(t) for t in items}),
        "paths": [list(p) for p in state.paths()],
        "collection_entries": sorted(type(v).__name__ for v in [state[c] for c in state.collections()]),
    }


def _loss(m):
    return jnp.sum(m(X[0]) ** 2)


def _clone(lib):
    m = _net(lib)
    c = lib.spx.clone(m)
    return [c is not m, c.enc is not m.enc, _out(c(X[0]))]


def _update(lib):
    m = _net(lib)
    return [lib.spx.update(m, lib.spx.tree_state(m)) is None, _out(m(X[0]))]


def _value_and_grad(lib):
    value, grads = lib.spx.value_and_grad(_loss)(_net(lib))
    return [_out(value), _state_summary(grads)]


def _jit(lib):
    f, m = lib.spx.jit(lambda m, x: m(x)), _net(lib)
    return [_out(f(m, X[0])), _out(f(m, X[0])), len(f._spx_compile_cache)]


def _mesh(lib):
    m = lib.spx.create_mesh((1, 2, -1, 1, 1, 1))
    return [list(m.jax_mesh.axis_names), dict(m.jax_mesh.shape)]


def _variable(cls):
    def probe(lib):
        v = getattr(lib.spx, cls)(jnp.ones(3))
        return [v.kind, type(v.value).__name__, _out(v.value)]

    return probe


def _count(lib, select):
    return len(list(lib.spx.iter_variables(_net(lib), select=select)))


def _specs(lib):
    s = lib.sharding.get_partition_spec(_net(lib))
    return [type(s).__name__, sorted(s), [sorted(e) for e in s.values()]]


def _named(lib):
    s = lib.sharding.get_named_sharding(_net(lib), lib.spx.create_mesh((1, 1, -1, 1, 1, 1)))
    return [
        type(s).__name__,
        [[c, sorted(e), sorted({type(v).__name__ for v in e.values()})] for c, e in s.items()],
    ]


SPX = {
    "export": lambda lib: [len(out := lib.spx.export(_net(lib))), _state_summary(out[1])],
    "tree_state": lambda lib: _state_summary(lib.spx.tree_state(_net(lib))),
    "bind": lambda lib: _out(lib.spx.bind(*lib.spx.export(_net(lib)))(X[0])),
    "clone": _clone,
    "update": _update,
    "pop": lambda lib: _state_summary(lib.spx.pop(_net(lib), "parameters")),
    "iter_variables": lambda lib: [p for p, _ in lib.spx.iter_variables(_net(lib))],
    "iter_modules": lambda lib: [
        [p, type(m).__name__] for p, m in lib.spx.iter_modules(_net(lib), skip_root=True)
    ],
    "live_variables": lambda lib: sorted(type(v).__name__ for v in lib.spx.live_variables(_net(lib))),
    "find": lambda lib: [(f := lib.spx.find(_net(lib), lib.nn.Linear))[0], type(f[1]).__name__],
    "grad": lambda lib: _state_summary(lib.spx.grad(_loss)(_net(lib))),
    "value_and_grad": _value_and_grad,
    "jit": _jit,
    "vmap": lambda lib: _out(lib.spx.vmap(lambda m, x: m(x), in_axes=(None, 0))(_net(lib), X)),
    "scan": lambda lib: _out(lib.spx.scan(lambda m, x: m(x), _net(lib), X)),
    "remat_scan": lambda lib: _out(lib.spx.remat_scan(lambda m, x: m(x), _net(lib), X)),
    "fori_loop": lambda lib: _out(
        lib.spx.fori_loop(0, 3, lambda i, m, c: c + jnp.sum(m(X[0])), _net(lib), jnp.zeros(()))
    ),
    "while_loop": lambda lib: _out(
        lib.spx.while_loop(lambda m, c: c[0] < 3, lambda m, c: (c[0] + 1, c[1] + 1.0), _net(lib), (0, 0.0))
    ),
    "cond": lambda lib: _out(lib.spx.cond(True, lambda m, x: m(x), lambda m, x: m(x) * 0, _net(lib), X[0])),
    "switch": lambda lib: _out(lib.spx.switch(1, [lambda m, x: m(x), lambda m, x: -m(x)], _net(lib), X[0])),
    "remat": lambda lib: _out(lib.spx.remat(lambda m, x: m(x))(_net(lib), X[0])),
    "eval_shape": lambda lib: _out(lib.spx.eval_shape(lambda m, x: m(x), _net(lib), X[0])),
    "select": lambda lib: len(lib.spx.select().at_instances_of(lib.nn.Linear).apply(_net(lib))),
    "of_type": lambda lib: _count(lib, lib.spx.of_type(lib.spx.Parameter)),
    "path_contains": lambda lib: [
        p for p, _ in lib.spx.iter_variables(_net(lib), select=lib.spx.path_contains("dec"))
    ],
    "path_startswith": lambda lib: _count(lib, lib.spx.path_startswith("enc")),
    "path_endswith": lambda lib: _count(lib, lib.spx.path_endswith("bias")),
    "create_mesh": _mesh,
    "Parameter": _variable("Parameter"),
    "Buffer": _variable("Buffer"),
    "Variable": _variable("Variable"),
}


def _rules(lib):
    with lib.sharding.logical_axis_rules([("embed", "fsdp"), ("mlp", "tp")]):
        inside = {k: v for k, v in lib.sharding.current_axis_rules().items() if k in ("embed", "mlp")}
    return [sorted(inside.items()), "embed" in lib.sharding.current_axis_rules()]


def _mesh_queries(lib):
    mesh = lib.spx.create_mesh((1, 2, -1, 1, 1, 1))
    with mesh:
        return [
            lib.sharding.names_in_current_mesh("dp", "fsdp"),
            lib.sharding.names_in_current_mesh("nope"),
            lib.sharding.get_axes_size_in_mesh(("dp", "fsdp")),
            lib.sharding.get_axes_size_in_mesh("fsdp"),
        ]


def _match_rules(lib):
    from jax.sharding import PartitionSpec

    tree = {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones((4,))}}
    specs = lib.sharding.match_partition_rules(
        [("kernel", PartitionSpec("fsdp", None)), (".*", PartitionSpec())], tree
    )
    return jax.tree.map(str, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _hook(lib):
    seen = []
    m = _net(lib)
    handle = lib.hooks.register_forward_hook(m.enc, lambda mod, args, kwargs, out: seen.append(_out(out)))
    m(X[0])
    handle.remove()
    m(X[0])
    return seen


SHARDING = {
    "get_partition_spec": _specs,
    "get_named_sharding": _named,
    "create_mesh": _mesh,
    "current_axis_rules": _rules,
    "logical_axis_rules": _rules,
    "names_in_current_mesh": _mesh_queries,
    "get_axes_size_in_mesh": _mesh_queries,
    "match_partition_rules": _match_rules,
}
INSPECT = {
    "count_parameters": lambda lib: int(lib.inspect.count_parameters(_net(lib))),
    "count_bytes": lambda lib: int(lib.inspect.count_bytes(_net(lib))),
}
HOOKS = {"register_forward_hook": _hook}

PROBES = {
    **{("spectrax.nn", k): v for k, v in NN.items()},
    **{("spectrax.functional", k): v for k, v in FUNCTIONAL.items()},
    **{("spectrax.init", k): v for k, v in INIT.items()},
    **{("spectrax", k): v for k, v in SPX.items()},
    **{("spectrax.sharding", k): v for k, v in SHARDING.items()},
    **{("spectrax.inspect", k): v for k, v in INSPECT.items()},
    **{("spectrax.hooks", k): v for k, v in HOOKS.items()},
    ("spectrax", "check_unintentional_sharing"): lambda lib: lib.spx.check_unintentional_sharing(_net(lib)),
}


def run_all(lib, names) -> dict[str, object]:
    """`{"module.name": result}`: the generic summary of every name, and its probe where written
    (an error is recorded as its type name)."""
    out = {}
    for module, name in names:
        obj = getattr(importlib.import_module(module.replace("spectrax", lib.spx.__name__, 1)), name, None)
        result = {"generic": generic(obj)}
        if (module, name) in PROBES:
            try:
                result["probe"] = json.loads(json.dumps(PROBES[(module, name)](lib)))
            except Exception as e:  # noqa: BLE001 - the error's type is the recorded behaviour
                result["probe"] = f"error: {type(e).__name__}"
        out[f"{module}.{name}"] = result
    return out


if __name__ == "__main__":
    rows = [line.split("\t")[:2] for line in (DATA.parent / "seed_interface.tsv").read_text().splitlines()]
    DATA.write_text(
        json.dumps(run_all(library(sys.argv[1] if len(sys.argv) > 1 else "spectrax"), rows), indent=1) + "\n"
    )
