"""Continuous batching: each row of a group takes the next prompt of a queue when its sequence ends.

The wavefront runs as for `generate`, one token per row a round, but the host
says what each row does (`Queue.plan`): a row that starts a prompt is fed its
tokens one a round at positions `0, 1, ...` (its prefill, interleaved with the
other rows' decode); from its last prompt token on, it emits a new token each
round, its sampling state restarted (step 0, the prompt's own key and budget),
so each prompt's tokens are those of the prompt decoded alone. A row's entries
from an earlier prompt need no clearing: a query at position p sees only
entries at positions <= p, and the new prompt writes those first.

A row ends after its budget (known on the host) or a stop token: the host
reads a group's tokens of round t − 2 before planning its round t (a round
late, so the read waits for nothing the devices are still queuing); the round
between is the row's last, wasted, one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import jax
import numpy as np

from .wavefront import Group


@dataclass
class Row:
    """A row's prompt (-1: none), its tokens fed and new tokens planned so far."""

    prompt: int = -1
    fed: int = 0
    made: int = 0


class Queue:
    """The prompts of every group (group i takes prompts i, i + groups, ...), the plan of each round,
    and which round and row made each prompt's k-th token."""

    def __init__(self, prompts: list, budgets: np.ndarray, groups: int, size: int, stop_tokens):
        self.prompts, self.budgets, self.stop = prompts, budgets, set(int(t) for t in stop_tokens)
        self.waiting = [deque(range(i, len(prompts), groups)) for i in range(groups)]
        self.rows = [[Row() for _ in range(size)] for _ in range(groups)]
        self.made: list[tuple] = []  # (group, round, row, prompt, k)
        self.emitted: dict[tuple, list] = {}  # (group, round) -> [(row, prompt)]
        self.stopped: set[int] = set()
        self.controls: dict[tuple, tuple] = {}

    def bound(self) -> int:
        """Rounds enough for every group: its prompts one after another."""
        return max(sum(len(self.prompts[p]) + self.budgets[p] for p in w) for w in self.waiting)

    def plan(self, g: Group) -> tuple[np.ndarray, np.ndarray] | None:
        """Stage 0's `(feed, positions)` of group `g`'s next round (its last stage's control kept for
        `control`); the group ends after this round when it has nothing left."""
        t, i = len(g.tokens), g.index
        if self.stop and t >= 2:
            self._observe(i, t - 2, np.asarray(g.tokens[t - 2]))
        rows = self.rows[i]
        feed, pos, ids, emit, fresh = (np.zeros(len(rows), np.int32) for _ in range(5))
        for r, row in enumerate(rows):
            if (row.prompt < 0 or self._finished(row)) and self.waiting[i]:
                rows[r] = row = Row(self.waiting[i].popleft())
            if row.prompt < 0 or self._finished(row):
                continue
            prompt, ids[r] = self.prompts[row.prompt], row.prompt
            if row.fed < len(prompt):
                feed[r], pos[r], row.fed = prompt[row.fed], row.fed, row.fed + 1
                fresh[r] = emit[r] = row.fed == len(prompt)
            else:
                feed[r], pos[r], emit[r] = -1, len(prompt) + row.made - 1, 1
            if emit[r]:
                self.made.append((i, t, r, row.prompt, row.made))
                self.emitted.setdefault((i, t), []).append((r, row.prompt))
                row.made += 1
        if not any(self.waiting[i]) and all(self._finished(row) or row.prompt < 0 for row in rows):
            g.rounds = t + 1
        self.controls[i] = (ids, emit.astype(bool), fresh.astype(bool))
        return feed, pos

    def control(self, g: Group) -> tuple:
        return self.controls[g.index]

    def _finished(self, row: Row) -> bool:
        return row.prompt >= 0 and (row.made >= self.budgets[row.prompt] or row.prompt in self.stopped)

    def _observe(self, group: int, t: int, tokens: np.ndarray) -> None:
        for r, p in self.emitted.pop((group, t), []):
            if int(tokens[r]) in self.stop:
                self.stopped.add(p)

    def tokens(self, out: np.ndarray, size: int, pad_id: int) -> np.ndarray:
        """Each prompt's new tokens `(prompts, largest budget)` from the rounds' tokens `out`."""
        result = np.full((len(self.prompts), int(self.budgets.max())), pad_id, np.int32)
        for i, t, r, p, k in self.made:
            result[p, k] = out[i * size + r, t]
        for p, row in enumerate(result):  # a prompt ends at its first stop token
            hits = [k for k, token in enumerate(row) if int(token) in self.stop]
            if hits:
                row[hits[0] + 1 :] = pad_id
        return result


def serve_cells(programs, weights, queue: Queue, layout, pad_id: int) -> list:
    """The wavefront's cells of continuous batching (see `wavefront.run_wavefront`)."""
    last = len(programs) - 1
    first_at, last_at = layout.sharding(0), layout.sharding(last)

    def cell(s: int):
        def run(g: Group, x, t: int):
            control = None
            if s == 0:
                x = (x, *jax.device_put(queue.plan(g), first_at))
            if s == last:
                control = jax.device_put(queue.control(g), last_at)
            out, g.caches[s], state = programs[s](
                weights[s], x, g.caches[s], g.state if s == last else None, control
            )
            if s == last:
                g.state = state
            return out, None

        return run

    return [cell(s) for s in range(last + 1)]
