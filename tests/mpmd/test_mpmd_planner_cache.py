"""The planner's profile cache holds data only: a profile read back equals the one stored; a file
that is cut short, of another format version, changed, foreign or a pickle is a miss with one
warning naming it (and `advise` profiles again and writes over it); reading a planted pickle never
runs it; files and the folders the cache creates are the user's only, and a folder others can
write to is used after a warning."""

import hashlib
import json
import os
import pickle
import warnings

import pytest
from planner_cases import MESH, init, lm_loss

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.schedules import StageMemory
from spectrax_mpmd._planner.cache import ProfileCache
from spectrax_mpmd._planner.profiler import MEASURED, Profiled, UpdateCost
from spectrax_mpmd._runtime import CellProfile, StageProfile

KEY = "ab" * 32


def _profiled() -> Profiled:
    cells = (
        CellProfile(0, 0, "F", 3.0e5, 1.5e5, 21508, 43200, 2048, 41088, 1.07e-4, 1.2e-4),
        CellProfile(0, 0, "I", 2.0e5, 1.0e5, 100, 200, 0, 64, None),
        CellProfile(1, 1, "FB", 1.0e6, 2.5e5, 300, 400, 512, 0, 3.5e-4, float("inf")),
    )
    memory = StageMemory(
        inputs=(0, 16), kept_inputs=(0, 0), residuals=(64, 0), grads=(16, 0), stash=(8, 0),
        params=(1024, 2048), accumulators=(1024, 2052), optimizer=(0, 0), other=(256, 256),
    )  # fmt: skip
    saved = ((((64, 64),), ()), ((), ()))  # per stage (residuals, stash): stage 0 saves one value
    stages = StageProfile(cells, (1024, 2048), (1024, 2052), ((0, 1, 16),), memory, (1024, 2048), saved)
    return Profiled(stages, UpdateCost((2048, 4096), (1.0e-5, 2.0e-5), True))


def _one_warning(caught, path) -> str:
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert str(path) in message
    return message


def _header(path) -> dict:
    return json.loads(path.read_bytes().partition(b"\n")[0])


class _Touch:
    """Unpickled, creates the file `path`: what a planted pickle could do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_profile_and_a_measurement_read_back_equal_to_what_was_stored(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    profiled, measured = _profiled(), (0.25, 0.5, 1.0e-5, 2.0e-4)
    cache.put(KEY, profiled)
    cache.put("cd" * 32, measured)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(KEY, Profiled) == profiled
        assert cache.get("cd" * 32, MEASURED) == measured
        assert cache.get("ef" * 32, Profiled) is None  # no file: a miss without a word
        assert cache.get(None, Profiled) is None
    assert _header(cache.path(KEY))["version"] == 2
    assert sorted(p.name for p in cache.directory.iterdir()) == [f"{'ab' * 32}.json", f"{'cd' * 32}.json"]


def _damaged(text: bytes, payload: bytes) -> dict:
    """`{case: (file bytes, what the warning says)}`: each kind of damage done to `text`, the bytes
    of a good file, and `payload`, a pickle, in its place."""
    head, _, body = text.partition(b"\n")
    header = json.loads(head)
    other_version = json.dumps({**header, "version": 1}).encode() + b"\n" + body
    foreign = json.dumps({**header, "key": "0" * 64}).encode() + b"\n" + body
    data = json.loads(body)
    data["stages"]["cells"][0]["flops"] = "many"  # a string where a number belongs, checksum made anew
    changed_body = json.dumps(data).encode()
    wrong_shape = json.dumps({**header, "sha256": hashlib.sha256(changed_body).hexdigest()}).encode()
    return {
        "truncated": (text[: len(text) // 2], "checksum does not match"),
        "header cut": (text[:20], "not JSON"),
        "other version": (other_version, "format version 1, this version reads 2"),
        "changed": (text.replace(b"21508", b"21509"), "checksum does not match"),
        "foreign": (foreign, "another key"),
        "wrong shape": (wrong_shape + b"\n" + changed_body, "expected a number, found 'many'"),
        "pickle": (payload, "not JSON"),
        "empty": (b"", "not JSON"),
    }


def test_a_damaged_or_foreign_file_is_a_miss_with_one_warning_naming_it(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    cache.put(KEY, _profiled())
    path = cache.path(KEY)
    good, payload = path.read_bytes(), pickle.dumps(_Touch(tmp_path / "ran"))
    for case, (text, reason) in _damaged(good, payload).items():
        path.write_bytes(text)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cache.get(KEY, Profiled) is None, case
        assert reason in _one_warning(caught, path), case
    cache.put(KEY, _profiled())  # what `advise` does after a miss: measure, then write over it
    assert path.read_bytes() == good
    assert not (tmp_path / "ran").exists()  # the pickle was never run; unpickled, it makes the file:
    pickle.loads(payload).close()
    assert (tmp_path / "ran").exists()


def test_files_and_created_folders_are_the_users_only(tmp_path):
    os.chmod(tmp_path, 0o700)
    cache = ProfileCache(tmp_path / "a" / "b" / "profiles")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a folder the cache made is private: no warning
        cache.put(KEY, _profiled())
        assert cache.get(KEY, Profiled) is not None
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache.directory):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    assert cache.path(KEY).stat().st_mode & 0o777 == 0o600
    assert [p.name for p in cache.directory.iterdir()] == [cache.path(KEY).name]  # no temporary left


@pytest.mark.parametrize(("mode", "who"), [(0o777, "other users"), (0o770, "its group")])
def test_a_folder_others_can_write_to_is_used_after_one_warning(tmp_path, mode, who):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    ProfileCache(tmp_path / "mine").put(KEY, _profiled())
    (tmp_path / "mine" / f"{KEY}.json").rename(shared / f"{KEY}.json")
    cache = ProfileCache(shared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get(KEY, Profiled) == _profiled()  # used
        cache.put(KEY, _profiled())
        assert cache.get(KEY, Profiled) == _profiled()
    message = _one_warning(caught, shared)
    assert f"lets {who} write" in message and "chmod 700" in message
    assert "SPECTRAX_MPMD_PROFILE_CACHE" in message


KWARGS = dict(mesh=MESH, schedules=(S.Std1F1B,), microbatches=(8,), virtual_stages=(1,), rounds=1)
KWARGS.update(confirm=0, search=False)


def build(n_stages):
    return lm_loss(n_stages), init()


@pytest.mark.slow
def test_advise_profiles_again_over_damaged_files_and_never_runs_a_planted_pickle(tmp_path):
    directory = tmp_path / "profiles"
    first = mp.advise(build, profile_cache=directory, **KWARGS)
    files = sorted(directory.iterdir())
    assert first.cached == 0 and len(files) == first.profiles + 1  # the profiles and one measured step
    files[0].write_bytes(files[0].read_bytes()[:100])  # cut short, as a full disk leaves it
    for path in files[1:]:
        path.write_bytes(pickle.dumps(_Touch(tmp_path / "ran")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = mp.advise(build, profile_cache=directory, **KWARGS)
    assert second.cached == 0 and second.profiles == first.profiles
    named = sorted(str(p) for p in files for w in caught if str(p) in str(w.message))
    assert named == [str(p) for p in files]  # one warning per file
    assert not (tmp_path / "ran").exists()
    third = mp.advise(build, profile_cache=directory, **KWARGS)  # written over: read back now
    assert third.cached == third.profiles == first.profiles
