"""The JAX names SpectraX reads from outside JAX's stable API: listed once
(`spectrax_mpmd._trace.jax_private`), read only through that list, and each private one giving what
its public fallback gives on a small case."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_import_direction import ROOT, imported_modules

import spectrax_mpmd as mp
from spectrax_core.schedules import GPipe
from spectrax_mpmd._comm import distributed, exchange, local, transfer_server
from spectrax_mpmd._compile import calls, compiler
from spectrax_mpmd._compile import relocate as relocation
from spectrax_mpmd._runtime import straight
from spectrax_mpmd._trace import context, jax_private

PACKAGES = ("spectrax_core", "spectrax_mpmd", "spectrax_eager")
LIST = ROOT / "spectrax_mpmd" / "_trace" / "jax_private.py"
OFF_LIMITS = ("jax._src", "jax.extend", "jax.interpreters", "jax.core")
PUBLIC_CORE = {"Tracer", "ShapedArray"}  # `jax.core` names stable over the supported versions
LISTED = {entry.path for entry in jax_private.PRIVATE}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of `tree` (they may name private modules freely)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        kind = isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        if kind and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            found.add(id(body[0].value))
    return found


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def findings(path: Path) -> list[str]:
    """What `path` reads from JAX around the list: imports of private or extension modules, `jax._src`
    strings outside a `private(...)` call, `private(...)` of an unlisted name, `jax.core` names
    other than `PUBLIC_CORE`, and attribute reads of private or extension modules."""
    tree = ast.parse(path.read_text())
    skip, inner, found = _docstrings(tree), set(), []
    for name in sorted(imported_modules(path)):
        if name.startswith(OFF_LIMITS):
            found.append(f"imports {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "private" and node.args:
            arg = node.args[0]
            skip.add(id(arg))
            if not (isinstance(arg, ast.Constant) and arg.value in LISTED):
                found.append(f"private({ast.unparse(arg)}) is not listed")
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            inner.add(id(node.value))  # only the whole chain counts, not its prefixes
            if (dotted := _dotted(node)) is None:
                continue
            head, _, last = dotted.rpartition(".")
            if head == "jax.core" and last not in PUBLIC_CORE or head.startswith(OFF_LIMITS[:3]):
                found.append(f"reads {dotted}")
    for node in ast.walk(tree):
        text = node.value if isinstance(node, ast.Constant) else None
        if isinstance(text, str) and "jax._src" in text and id(node) not in skip:
            found.append(f"names {text!r}")
    return sorted(set(found))


def _package_files() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py")) if p != LIST]


def test_a_planted_read_around_the_list_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr("test_import_direction.ROOT", tmp_path)
    planted = tmp_path / "spectrax_mpmd" / "_x.py"
    planted.parent.mkdir()
    planted.write_text(
        '"""Docstrings may name jax._src.core."""\n'
        "import jax\n"
        "from jax.extend.core import Var\n"
        "from jax.interpreters import ad\n"
        "def f(x):\n"
        "    from jax._src import config\n"
        "    mod = __import__('jax._src.core')\n"
        "    fn = private('jax._src.secret')\n"
        "    ok = private('jax._src.config.trace_context')\n"
        "    return isinstance(x, jax.core.Tracer), jax.core.Primitive, jax.extend.core.Literal\n"
    )
    assert findings(planted) == [
        "imports jax._src",
        "imports jax._src.config",
        "imports jax._src.core",
        "imports jax.extend.core",
        "imports jax.extend.core.Var",
        "imports jax.interpreters",
        "imports jax.interpreters.ad",
        "names 'jax._src.core'",
        "private('jax._src.secret') is not listed",
        "reads jax.core.Primitive",
        "reads jax.extend.core.Literal",
    ]


def test_every_private_or_extension_name_is_read_through_the_list():
    found = [f"{p.relative_to(ROOT)}: {line}" for p in _package_files() for line in findings(p)]
    assert not found, "read these through spectrax_mpmd/_trace/jax_private.py:\n" + "\n".join(found)


def test_every_listed_name_is_read_where_the_list_says():
    texts = {p: p.read_text() for p in _package_files()}
    for entry in jax_private.PRIVATE:
        where = ROOT / entry.reader.replace(".", "/")
        readers = [p for p in texts if p.with_suffix("") == where or where in p.parents]
        assert any(f'private("{entry.path}")' in texts[p] for p in readers), entry
    for entry in jax_private.ATTRIBUTES:
        attribute = entry.path.split(".")[-2]  # the object's attribute the reader opens
        reader = (ROOT / entry.reader.replace(".", "/")).with_suffix(".py")
        assert re.search(rf"\b{attribute}\b", reader.read_text()), entry
    imported = {a.name for p in texts for a in _from_list(p)}
    assert imported == {*jax_private.EXTENSION, "private"}


def _from_list(path: Path) -> list[ast.alias]:
    """The names `path` imports from `jax_private`."""
    nodes = ast.walk(ast.parse(path.read_text()))
    return [
        a
        for n in nodes
        if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("jax_private")
        for a in n.names
    ]


def test_an_unlisted_name_is_refused():
    with pytest.raises(KeyError, match="not listed"):
        jax_private.private("jax._src.core.Tracer")
    assert all(jax_private.private(path) is not None for path in LISTED), "this JAX lacks a listed name"


# --- each private name against its public fallback -------------------------------------------------


def _config_changes(key) -> list[bool]:
    """Whether `key()` differs from its value outside, under each of a few configuration contexts."""
    base = key()
    contexts = [jax.default_matmul_precision("highest"), jax.numpy_rank_promotion("raise")]
    changed = []
    for ctx in contexts:
        with ctx:
            changed.append(key() != base)
    return [*changed, key() != base]


def test_trace_context_and_every_config_value_change_alike(monkeypatch):
    private = _config_changes(context.config_key)
    monkeypatch.setattr(context, "_trace_context", None)
    assert _config_changes(context.config_key) == private == [True, True, False]


def _activity() -> list[bool]:
    """`active_trace()` outside, and inside jit, make_jaxpr, scan and checkpoint traces."""
    seen = [context.active_trace()]

    def probe(x):
        seen.append(context.active_trace())
        return x

    jax.jit(lambda x: probe(x))(1.0)  # a fresh function each: JAX caches traces per function
    jax.make_jaxpr(lambda x: probe(x))(1.0)
    jax.lax.scan(lambda c, _: (probe(c), None), 1.0, None, length=1)
    jax.checkpoint(lambda x: probe(x))(1.0)
    return seen


def test_trace_state_and_the_probe_primitive_see_the_same_traces(monkeypatch):
    private = _activity()
    monkeypatch.setattr(context, "_trace_state_clean", None)
    assert _activity() == private == [False, True, True, True, True]


def test_a_relocated_program_equals_a_fresh_compile():
    devices = jax.devices()
    x = jnp.arange(8.0)
    fn = jax.jit(lambda v: jnp.sin(v) * 2 + 1)
    compiled = fn.lower(jax.device_put(x, devices[0])).compile()
    source = relocation.serialized(compiled, [devices[0]])
    assert source is not None, "relocation is unavailable on this JAX"
    moved = relocation.relocate(source, [devices[1]])
    on_1 = jax.device_put(x, devices[1])
    fresh = fn.lower(on_1).compile()  # the fallback: compile for the new device
    got, want = moved(on_1), fresh(on_1)
    assert got.devices() == want.devices() == {devices[1]}
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_compilation_cache_state_and_the_configuration_agree(monkeypatch):
    assert relocation._CACHE_STATE is not None
    private = relocation.persistent_cache_active()
    monkeypatch.setattr(relocation, "_CACHE_STATE", None)
    assert relocation.persistent_cache_active() == private == relocation.persistent_cache_configured()


def test_the_distributed_state_and_the_environment_agree(monkeypatch):
    private = (transfer_server._advertised_host(), exchange._client())
    for module in (transfer_server, exchange):
        monkeypatch.setattr(module, "private", lambda path: None)
    assert (transfer_server._advertised_host(), exchange._client()) == private == ("127.0.0.1", None)


def test_the_batched_copy_equals_device_put():
    assert local.fast_path_available()
    devices = jax.devices()
    meshes = [jax.sharding.Mesh(np.array(ds).reshape(2, 2), ("a", "b")) for ds in (devices[:4], devices[4:])]
    src, dst = (NamedSharding(mesh, P("a")) for mesh in meshes)
    one = jax.sharding.SingleDeviceSharding(devices[1])
    arrays = [jax.device_put(jnp.arange(8.0).reshape(4, 2), src), jnp.ones(3, jnp.int32)]
    move = local._Copy([dst, one])
    for got, want in zip(move(*arrays), move.public()(*arrays), strict=True):
        assert got.sharding == want.sharding and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cluster_detection_agrees_with_jax_distributed_initialize():
    """Outside any cluster, the private detection finds none, and JAX's public
    `jax.distributed.initialize()` (what the fallback leaves the decision to) refuses for want of
    a coordinator."""
    assert distributed._cluster_detected() is False
    script = "import jax\ntry:\n    jax.distributed.initialize()\nexcept ValueError as e:\n    print(e)\n"
    cleared = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "JAX_", "TPU_"))}
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=dict(cleared, JAX_PLATFORMS="cpu"),
        check=False,
    )
    assert "coordinator_address should be defined" in result.stdout, result.stdout + result.stderr


def _small_step():
    """A fresh 2-rank GPipe step's run (loss and gradients) of a 2-layer tanh MLP."""

    def loss(w, x):
        h = mp.sxstage_iter(jnp.tanh(x @ w["a"]))
        return jnp.mean((h @ w["b"]) ** 2)

    w = {"a": jnp.full((4, 8), 0.1), "b": jnp.full((8, 2), 0.2)}
    x = jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), devices=jax.devices()[:2], mpmd_axis="pp")
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=GPipe(microbatches=2), batch_argnums=(1,))
    return step(w, x)


def _bit_equal(private, public) -> None:
    for a, b in zip(jax.tree.leaves(private), jax.tree.leaves(public), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_step_without_the_lowering_compile_args_gives_the_same_loss_and_gradients(monkeypatch):
    lowered = jax.jit(jnp.sin).lower(1.0)
    assert compiler._compile_args(lowered) is not None, "this JAX has no compile arguments"
    private = _small_step()
    monkeypatch.setattr(compiler, "_compile_args", lambda lowered: None)
    _bit_equal(private, _small_step())


def test_a_step_calling_its_compiled_objects_gives_the_same_loss_and_gradients(monkeypatch):
    compiled = jax.jit(jnp.sin).lower(1.0).compile()
    assert calls.direct_call(compiled) is not compiled, "this JAX makes no C++ call of a program"
    private = _small_step()
    monkeypatch.setattr(straight, "direct_call", lambda fn: fn)
    _bit_equal(private, _small_step())


# each test of both paths -> the listed names it checks
CHECKED = {
    test_trace_context_and_every_config_value_change_alike: ("jax._src.config.trace_context",),
    test_trace_state_and_the_probe_primitive_see_the_same_traces: ("jax._src.core.trace_state_clean",),
    test_a_relocated_program_equals_a_fresh_compile: (
        "jax._src.compiler.get_compile_options",
        "jax.experimental.serialize_executable._JaxPjrtUnpickler",
        "jax.stages.Compiled._executable._unloaded_executable.device_list",
    ),
    test_the_compilation_cache_state_and_the_configuration_agree: ("jax._src.compilation_cache",),
    test_the_distributed_state_and_the_environment_agree: ("jax._src.distributed.global_state",),
    test_the_batched_copy_equals_device_put: (
        "jax._src.lib.xla_client.batched_copy_array_to_devices_with_sharding",
        "jax._src.lib.xla_client.ArrayCopySemantics",
        "jax.sharding.NamedSharding._internal_device_list",
    ),
    test_cluster_detection_agrees_with_jax_distributed_initialize: ("jax._src.clusters.ClusterEnv",),
    test_a_step_without_the_lowering_compile_args_gives_the_same_loss_and_gradients: (
        "jax.stages.Lowered._lowering.compile_args",
    ),
    test_a_step_calling_its_compiled_objects_gives_the_same_loss_and_gradients: (
        "jax.stages.Compiled._executable.create_cpp_call",
        "jax.stages.Compiled._params",
    ),
}


def test_every_listed_name_has_an_equality_test():
    checked = [path for paths in CHECKED.values() for path in paths]
    assert sorted(checked) == sorted(LISTED | {entry.path for entry in jax_private.ATTRIBUTES})
