"""Small all-gathers among the processes of a job, through JAX's coordination service.

The runtime exchanges a few strings between processes: transfer-server
addresses, per-process partial sums for a global gradient norm, and
fingerprints of each process's arguments. Device
collectives (`multihost_utils.process_allgather`) can do that, but on CPU a
collective that blocks one process while a peer still pulls a transfer from it
can deadlock the two (measured here with two devices per process), so the
runtime uses the `jax.distributed` key-value store instead: no devices, no
collectives. The client is private JAX API, feature-detected; where it is
missing, the public collective is the fallback.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from .._env import configured_timeout
from .._trace.jax_private import private
from ..errors import DistributedError, PeerLostError

_SLICE_MS = 100  # how often a wait that can see peers end looks whether one has
_LAST_WORD_S = 1.0  # how long process 0 lets the others print an error they all raise
_NEEDED = ("key_value_set", "blocking_key_value_get", "key_value_increment", "key_value_delete")


def _client():
    client = getattr(private("jax._src.distributed.global_state"), "client", None)
    return client if client is not None and all(hasattr(client, m) for m in _NEEDED) else None


class Exchange:
    """All-gathers of short strings for one purpose (`kind`) among every process of the job.

    Processes make their exchanges in the same order (the same script), so the k-th
    exchange of a kind in one process is the k-th in every other; call i of
    `allgather` meets call i everywhere.
    """

    def __init__(self, kind: str, timeout: float | None = None):
        self.client = _client()
        self.me, self.world = jax.process_index(), jax.process_count()
        self.timeout = configured_timeout() if timeout is None else float(timeout)
        self.calls = 0
        if self.client is not None:
            k = self.client.key_value_increment(f"spectrax_mpmd/{kind}/made/{self.me}", 1)
            self.prefix = f"spectrax_mpmd/{kind}/{k}"

    def allgather(self, value: str, timeout: float | None = None, peers=None) -> list[str]:
        """Every process's `value`, indexed by process; each waited for up to `timeout` seconds
        (default: this exchange's). A process that does not come is named in the error, with
        what it said it waits for if it said so (`announce`). With `peers` (`liveness.Peers`), a
        process that has ended is named at once (`PeerLostError`) instead of waited for."""
        if self.client is None:
            return _collective_allgather(value)
        limit = self.timeout if timeout is None else timeout
        n, self.calls = self.calls, self.calls + 1
        self.client.key_value_set(f"{self.prefix}/{n}/{self.me}", value)
        out = []
        for p in range(self.world):
            if p == self.me:
                out.append(value)
                continue
            try:
                out.append(self._get(f"{self.prefix}/{n}/{p}", limit, p, peers))
            except PeerLostError:
                raise
            except Exception as err:  # noqa: BLE001 - JAX raises its runtime error type
                said = heard("waiting", p, 1.0)
                state = f"it is alive and waits {said}" if said else "it may have died or stalled"
                why = "" if isinstance(err, TimeoutError) else f" ({str(err).splitlines()[0]})"
                raise DistributedError(
                    f"process {self.me}: process {p} did not reach the exchange {self.prefix}/{n} within "
                    f"{limit:g} s{why}; {state}."
                ) from err
        if n >= 2:  # every process has read call n-2 once it has reached call n
            self.client.key_value_delete(f"{self.prefix}/{n - 2}/{self.me}")
        return out

    def raise_together(self, error: Exception) -> None:
        """Raise `error`, which every process raises at this point, once all have reached it; process
        0 a moment after the others: it serves the job's coordination service, and its end would
        make JAX abort a process still printing its own error."""
        self.allgather("refused")
        if self.me == 0 and self.world > 1:
            time.sleep(_LAST_WORD_S)
        raise error

    def _get(self, key: str, limit: float, process: int, peers) -> str:
        """The value at `key`, waited for up to `limit` s: in slices when `peers` can tell that
        `process` has ended meanwhile."""
        if peers is None:
            return self.client.blocking_key_value_get(key, int(limit * 1000))
        deadline = time.monotonic() + limit
        while True:
            try:
                return self.client.blocking_key_value_get(key, _SLICE_MS)
            except Exception:  # noqa: BLE001 - not there yet (JAX raises its runtime error type)
                how = peers.failed.get(process)
                if how is not None:
                    raise PeerLostError(f"process {self.me}: process {process} {how}.") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(key) from None


def announce(kind: str, value: str) -> None:
    """Post this process's latest `value` of `kind` (e.g. what it waits for) for the others to read;
    nothing where the key-value store is unavailable."""
    client = _client()
    if client is not None:
        client.key_value_set(f"spectrax_mpmd/said/{kind}/{jax.process_index()}", value, allow_overwrite=True)


def heard(kind: str, process: int, wait: float) -> str | None:
    """What `process` posted of `kind`, waiting up to `wait` seconds for it; None if nothing came
    (or the key-value store is unavailable or unreachable)."""
    client = _client()
    if client is None:
        return None
    try:
        return client.blocking_key_value_get(f"spectrax_mpmd/said/{kind}/{process}", max(1, int(wait * 1000)))
    except Exception:  # noqa: BLE001 - JAX raises its runtime error type: nothing was said
        return None


def _collective_allgather(value: str) -> list[str]:
    """The public fallback: two `process_allgather`s, of the encoded strings' lengths, then of the
    strings padded to the longest."""
    from jax.experimental import multihost_utils  # the fallback only: JAX's multi-host helpers

    encoded = np.frombuffer(value.encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(encoded.size))).reshape(-1)
    raw = np.zeros(max(1, int(sizes.max())), np.uint8)
    raw[: encoded.size] = encoded
    table = np.asarray(multihost_utils.process_allgather(raw)).reshape(sizes.size, raw.size)
    return [bytes(row[:n]).decode() for row, n in zip(table, sizes)]
