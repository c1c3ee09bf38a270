"""Relocation and JAX's persistent compilation cache.

An executable JAX loaded from its persistent cache cannot be serialized again
faithfully, so programs are not relocated while the cache is in use. JAX keeps
using a cache it has opened even after the cache directory is set back to None;
"in use" therefore follows JAX's own state, not only its configuration.
"""

from __future__ import annotations

import json
import subprocess
import sys

from spectrax_mpmd._compile import relocate as _relocate

ON_THEN_OFF = """
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._compile.relocate import persistent_cache_active, persistent_cache_configured

def loss(params, x):
    for k, w in enumerate(params):
        x = jnp.tanh(x @ w + 0.1 * k)
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return jnp.mean(x**2)

def states():
    return [persistent_cache_active(), persistent_cache_configured()]

params = [jnp.eye(4) * (k + 1) / 4 + 0.05 for k in range(4)]
mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp")
step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.Std1F1B(microbatches=4))
report = {"start": states()}
for batch, cache in ((8, "on"), (16, "off")):
    jax.config.update("jax_compilation_cache_dir", sys.argv[1] if cache == "on" else None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    report[cache + " before"] = states()
    x = jnp.linspace(-1, 1, batch * 4).reshape(batch, 4)
    got, want = step(params, x), jax.value_and_grad(loss)(params, x)
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want))
    exact = all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    report[cache] = {"exact": bool(exact), "relocated": step.timings()["relocated"], "states": states()}
print(json.dumps(report))
"""


def test_cache_turned_off_after_use_keeps_relocation_off(tmp_path):
    """Cache on, then off, in one process, twice (a cold cache, then a warm one): every gradient
    exact, nothing relocated once JAX has opened the cache."""
    script = tmp_path / "on_then_off.py"
    script.write_text(ON_THEN_OFF)
    cache = tmp_path / "cache"

    def run() -> dict:
        command = [sys.executable, str(script), str(cache)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    for run_report in (run(), run()):
        assert run_report["on"] == {"exact": True, "relocated": 0, "states": [True, True]}
        assert run_report["off"]["exact"] and run_report["off"]["relocated"] == 0
        # JAX's state and the configuration agree until the cache is turned off after use
        assert run_report["start"] == [False, False]
        assert run_report["on before"] == [True, True]
        if _relocate._CACHE_STATE is not None:
            assert run_report["off before"] == run_report["off"]["states"] == [True, False]
    assert any(cache.iterdir())


def test_without_jax_state_the_configuration_decides(monkeypatch):
    """In this process the cache was never turned on: both paths say it is off (or both on, when
    the environment configures one)."""
    assert _relocate.persistent_cache_active() == _relocate.persistent_cache_configured()
    monkeypatch.setattr(_relocate, "_CACHE_STATE", None)
    assert _relocate.persistent_cache_active() == _relocate.persistent_cache_configured()
