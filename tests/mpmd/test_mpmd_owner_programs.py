"""Owner-rank init programs: each device set's leaves made by one compiled program, sharded as kept.

A class of inits (normal, truncated normal, uniform, scaled and shifted, integer leaves, a
reduction) on device sets of one and of two devices, leaves replicated or split over a
tensor axis: the values are `jax.jit(init)(key)`'s on one device (bit for bit at XLA's default
optimisation, checked in a subprocess; within `ULPS` rounding steps at the suite's LLVM `-O0`,
where the generated code differs with what a program fuses),
each leaf has the sharding asked for, no device holds a leaf of another set, and a program
that is the same on two device sets is compiled once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_mpmd._checkpoint.owner_programs import make_leaves

ULPS = 4  # rounding steps of a leaf's largest magnitude, at the suite's -O0 (0 at default optimisation)


def unit(w):
    return w / jnp.linalg.norm(w)


def init(key):
    k = jax.random.split(key, 6)
    return {
        "normal": jax.random.normal(k[0], (16, 8)) / 3.0**0.5,
        "truncated": jax.random.truncated_normal(k[1], -2.0, 2.0, (8, 16)) * 0.02,
        "uniform": jax.random.uniform(k[2], (16, 16), minval=-0.1, maxval=0.1),
        "shifted": 1.0 + 0.5 * jax.random.normal(k[3], (8,)),
        "ids": jax.random.randint(k[4], (4, 8), 0, 100),
        "normed": unit(jax.random.normal(k[5], (8, 8))),
    }


def layouts() -> dict:
    """Per leaf its sharding: two 2-device sets (one split over 'tp'), one 1-device set."""
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    a = jax.sharding.Mesh(devices[0], ("tp",))
    b = jax.sharding.Mesh(devices[1], ("tp",))
    one = jax.sharding.Mesh(np.array(jax.devices()[4:5]), ("tp",))
    return {
        "normal": NamedSharding(a, PartitionSpec(None, "tp")),
        "truncated": NamedSharding(a, PartitionSpec("tp")),
        "uniform": NamedSharding(b, PartitionSpec("tp", None)),
        "shifted": NamedSharding(b, PartitionSpec()),
        "ids": NamedSharding(one, PartitionSpec()),
        "normed": NamedSharding(one, PartitionSpec()),
    }


def made(key):
    closed, abstract = jax.make_jaxpr(init, return_shape=True)(key)
    leaves, treedef = jax.tree.flatten(abstract)
    shardings = jax.tree.leaves(layouts())  # the same (sorted) key order as init's dict
    return treedef.unflatten(make_leaves(closed, key, shardings, leaves))


def ulps(a, b) -> float:
    """The largest difference of `a` and `b` in rounding steps of the leaf's largest magnitude."""
    a, b = np.asarray(a), np.asarray(b)
    if not np.issubdtype(a.dtype, np.floating):
        return float(np.any(a != b))
    scale = np.spacing(max(np.max(np.abs(a), initial=0), np.max(np.abs(b), initial=0)))
    return float(np.max(np.abs(a - b), initial=0) / scale)


def test_each_leaf_is_made_on_its_devices_with_its_sharding():
    got = made(jax.random.key(3))
    want = layouts()
    for name, x in got.items():
        assert x.sharding == want[name], name
        assert {s.device for s in x.addressable_shards} == set(want[name].device_set), name


def test_the_values_are_those_of_the_jitted_init_within_a_few_rounding_steps():
    key = jax.random.key(3)
    got, want = made(key), jax.jit(init)(key)
    distances = {name: ulps(got[name], want[name]) for name in want}
    assert max(distances.values()) <= ULPS, distances


VALUES = """
import json, sys
import jax, numpy as np
sys.path.insert(0, {here!r})
import test_mpmd_owner_programs as t
key = jax.random.key(3)
got, want = t.made(key), jax.jit(t.init)(key)
print(json.dumps({{n: t.ulps(got[n], want[n]) for n in want}}))
"""


def at_default_optimisation(code: str, timeout: int = 240) -> dict:
    """The JSON `code` (formatted with `here`, this folder) prints last, run in a process of its
    own at XLA's default optimisation (the suite's `-O0` flag dropped)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    code = code.format(here=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_at_default_optimisation_the_values_are_those_of_the_jitted_init_bit_for_bit():
    distances = at_default_optimisation(VALUES)
    assert set(distances.values()) == {0.0}, distances


def test_a_program_that_is_the_same_on_two_device_sets_is_compiled_once(monkeypatch):
    from spectrax_mpmd._compile import compiler as compiler_module

    compiled = []
    original = compiler_module.Compiler.prefetch

    def counting(self, specs):
        original(self, specs)
        compiled.append((self.stats.compiled, self.stats.relocated))

    monkeypatch.setattr(compiler_module.Compiler, "prefetch", counting)
    key = jax.random.key(0)

    def twice(k):  # the same leaves from the same key: one program, on two device sets
        return jnp.ones((8, 8)) * 2.0, jnp.ones((8, 8)) * 2.0

    closed, abstract = jax.make_jaxpr(twice, return_shape=True)(key)
    one, two = (
        NamedSharding(jax.sharding.Mesh(np.array([d]), ("x",)), PartitionSpec()) for d in jax.devices()[:2]
    )
    made_twice = make_leaves(closed, key, [one, two], list(abstract))
    assert [x.sharding for x in made_twice] == [one, two]
    np.testing.assert_array_equal(made_twice[0], made_twice[1])
    assert compiled and compiled[0][0] == 1, compiled
