"""Checkpoint integrity: every array's contents are checksummed at save and checked at restore.

A byte flipped in any of a checkpoint's data files either leaves the values
intact (a restore then succeeds) or changes them, and then the restore raises
a `CheckpointError` naming the step and an array whose values changed; with
`checksums=False` the same files restore unchecked. A truncated, emptied or
deleted data file (or a missing `meta`) is a `CheckpointError` naming the step
and, where orbax says it, the array. The checksum itself
changes with every single-bit flip and with swapped elements, whatever the
dtype, and does not depend on the array's sharding.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import shutil
import sys
import types
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.tree_util import keystr, tree_flatten_with_path

import spectrax_mpmd as mp
from spectrax_core.models import TransformerLM
from spectrax_mpmd._checkpoint.digest import checksums

pytest.importorskip("orbax.checkpoint")
# when one read of a damaged file fails, orbax leaves its other reads unawaited; Python reports them
# when they are collected, which `_unreadable` makes happen (quietly) in the test expecting the failure
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEP = 1


def _lm():
    return TransformerLM.init(jax.random.key(0), vocab_size=64, d_model=32, n_layers=4, n_heads=2, d_ff=64)


def _opt_state(lm):
    return {"mu": jax.tree.map(lambda x: x * 0.5, lm), "count": jnp.int32(7), "key": jax.random.key(3)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An LM cut into 4 stages with a tree optimizer state (a typed key in it), saved as step 1."""
    directory = tmp_path_factory.mktemp("ckpt")
    lm = _lm()
    mp.save_checkpoint(directory, STEP, params=mp.stage_blocks(lm, 4), opt_state=_opt_state(lm))
    return directory, lm


def _copy(directory: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(directory, target)
    return target


def _data_files(directory: Path, item: str = "*") -> list[Path]:
    """The step's OCDBT data files (of one item, or of all), smallest first."""
    found = (directory / str(STEP)).glob(f"{item}/ocdbt.process_*/d/*")
    return sorted(found, key=lambda p: (p.stat().st_size, p.name))


def _flip(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x5A
    path.write_bytes(bytes(data))


def _named(tree) -> dict:
    """`{checkpoint name without a layer index: values}` of a tree's leaves (keys as their data)."""
    out = {}
    for path, x in tree_flatten_with_path(tree)[0]:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out[keystr(path).lstrip(".")] = np.asarray(x)
    return out


def _changed(restored, lm) -> set[str]:
    """The leaves whose restored values differ from the saved ones."""
    got = {**_named(restored.params), **_named(restored.opt_state)}
    want = {**_named(lm), **_named(_opt_state(lm))}
    assert got.keys() == want.keys()
    return {k for k in want if not np.array_equal(got[k], want[k])}


def _restore(directory: Path, lm, **kw):
    return mp.restore_checkpoint(directory, like=lm, opt_like=_opt_state(lm), **kw)


class _Unretrieved(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" records (orbax's failed reads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


def _from_orbax(code) -> bool:
    return code is not None and "orbax" in code.co_filename


def _raised_in_orbax(err) -> bool:
    tb = getattr(err, "__traceback__", None)
    while tb is not None and not _from_orbax(tb.tb_frame.f_code):
        tb = tb.tb_next
    return tb is not None


def _finish_orbax_reads() -> None:
    """Finish what a failed orbax restore leaves behind, quietly: its reads still waiting on
    TensorStore (closed: their loop is closed and never resumes them, so they would live until
    the interpreter exits and be reported then), its tasks (not reported as destroyed while
    pending) and its failed futures (their exceptions retrieved)."""
    gc.collect()
    for obj in gc.get_objects():
        if isinstance(obj, types.CoroutineType) and _from_orbax(obj.cr_code):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - orbax turns the close into its read error
                pass
        elif isinstance(obj, asyncio.Future):
            if isinstance(obj, asyncio.Task) and _from_orbax(getattr(obj.get_coro(), "cr_code", None)):
                obj._log_destroy_pending = False
            if obj.done() and not obj.cancelled() and _raised_in_orbax(obj.exception()):
                pass  # retrieved (just now): asyncio logs no "exception was never retrieved"
    gc.collect()


def _unreadable(match: str, directory: Path, lm, **kw) -> str:
    """The message of the `CheckpointError` restoring `directory` raises (it must match `match`).

    A read orbax cannot finish leaves its other reads unawaited (`_finish_orbax_reads` ends
    them here), else reported as tracebacks after the session's summary. Meanwhile asyncio's
    "... exception was never retrieved", Python's "Exception ignored in: <coroutine ...>" and
    "coroutine ... was never awaited" for orbax's reads are dropped; other reports pass on.
    """
    quiet, asyncio_log, hook = _Unretrieved(), logging.getLogger("asyncio"), sys.unraisablehook

    def drop_orbax_reads(unraisable):
        if not _from_orbax(getattr(unraisable.object, "cr_code", None)):
            hook(unraisable)

    asyncio_log.addFilter(quiet)
    sys.unraisablehook = drop_orbax_reads
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "coroutine '_read_array", RuntimeWarning)
            with pytest.raises(mp.CheckpointError, match=match) as err:
                _restore(directory, lm, **kw)
            text = str(err.value)
            del err
            _finish_orbax_reads()
    finally:
        sys.unraisablehook = hook
        asyncio_log.removeFilter(quiet)
    return text


@pytest.mark.parametrize("at", [0.5, 0.3])
def test_a_flipped_byte_in_any_data_file_is_caught_or_harmless(saved, tmp_path, at):
    directory, lm = saved
    caught = 0
    assert len(_data_files(directory)) >= 6
    for k in range(len(_data_files(directory))):
        copy = _copy(directory, tmp_path)
        damaged = _data_files(copy)[k]
        _flip(damaged, at)
        try:
            changed = _changed(_restore(copy, lm, checksums=False), lm)  # what the flip did, unchecked
        except mp.CheckpointError:  # the flip broke the compressed stream itself: never read silently
            _unreadable(rf"step {STEP} in .* cannot be read", copy, lm)
            caught += 1
            continue
        if not changed:
            _restore(copy, lm)  # intact values pass the check
            continue
        with pytest.raises(mp.CheckpointError, match=rf"step {STEP}'s (params|opt_state) array") as err:
            _restore(copy, lm)
        name = re.search(r"array (['\"])(.+?)(\[\d+\])?\1 does not match", str(err.value))[2]
        assert name in changed, (damaged.name, name, changed)
        caught += 1
    assert caught >= 1  # some flip reached array values (how many files hold values varies per save)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _empty, Path.unlink], ids=["truncated", "emptied", "deleted"])
@pytest.mark.parametrize("item", ["params", "opt_state"])
def test_an_unreadable_data_file_names_the_step_and_array(saved, tmp_path, damage, item):
    directory, lm = saved
    copy = _copy(directory, tmp_path)
    damage(_data_files(copy, item)[-1])  # the largest: it holds array chunks
    for checked in (True, False):
        unreadable = rf"step {STEP} in .* cannot be read \({item} array"
        text = _unreadable(unreadable, copy, lm, checksums=checked)
        assert "holds [1]" in text and "TensorStore" not in text and len(text) < 600, text


def test_a_missing_meta_file_names_the_step(saved, tmp_path):
    directory, lm = saved
    copy = _copy(directory, tmp_path)
    (copy / str(STEP) / "meta" / "metadata").unlink()
    with pytest.raises(mp.CheckpointError, match=rf"step {STEP} in .* cannot be read \(FileNotFoundError"):
        _restore(copy, lm)


def test_the_checksums_are_recorded_in_meta(saved):
    directory, lm = saved
    meta = json.loads((directory / str(STEP) / "meta" / "metadata").read_text())
    assert meta["checksums"].keys() == {"params", "opt_state"}
    assert meta["checksums"]["params"].keys() == meta["params"].keys()
    assert meta["checksums"]["opt_state"].keys() == meta["opt_state"].keys()
    assert all(re.fullmatch(r"[0-9a-f]{8}", c) for c in meta["checksums"]["params"].values())


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    tree = {"w": jnp.arange(4096, dtype=jnp.float32)}
    with mp.CheckpointManager(tmp_path, checksums=False) as manager:
        manager.save(STEP, params=tree)
    meta = json.loads((tmp_path / str(STEP) / "meta" / "metadata").read_text())
    assert "checksums" not in meta
    _flip(_data_files(tmp_path, "params")[-1], 0.5)
    got = mp.restore_checkpoint(tmp_path, like=tree)  # nothing recorded: nothing to check against
    assert not np.array_equal(got.params["w"], tree["w"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.uint32])
def test_the_checksum_changes_with_every_bit_flip_and_swap(dtype):
    x = np.asarray(jax.random.normal(jax.random.key(1), (3, 5)) * 50).astype(dtype)
    original = checksums([jnp.asarray(x)])[0]
    raw = x.reshape(-1).view(np.uint8)
    variants = []
    for byte in range(raw.size):
        for bit in (0, 7):
            flipped = raw.copy()
            flipped[byte] ^= 1 << bit
            variants.append(flipped.view(x.dtype).reshape(x.shape))
    swapped = x.copy()
    swapped[0, 0], swapped[2, 4] = x[2, 4], x[0, 0]
    assert not np.array_equal(swapped, x)
    variants.append(swapped)
    got = [checksums([jnp.asarray(v)])[0] for v in variants]
    assert original not in got


def test_the_checksum_does_not_depend_on_the_sharding():
    x = jax.random.normal(jax.random.key(2), (8, 6))
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    placed = [
        x,
        jax.device_put(x, jax.devices()[5]),
        jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b"))),
        jax.device_put(x, NamedSharding(mesh, PartitionSpec(None, "a"))),
        jax.device_put(x, NamedSharding(mesh, PartitionSpec())),
    ]
    assert len(set(checksums(placed))) == 1
    assert checksums([x + 1])[0] != checksums([x])[0]
