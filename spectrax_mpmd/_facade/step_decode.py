"""Pipelined generation with any decode step cut at its `sxstage_iter` markers.

`StepDecoder(step, params, init_cache, mesh=...)` takes the user's
`step(params, cache, tokens, positions) -> (logits, cache)` and
`init_cache(batch, max_len) -> cache`. The step is traced and cut into one
stage per pipeline rank (x the schedule's virtual stages); each stage reads
only the params it uses, placed on its rank once (a leaf a pipelined training
step left there is used as it is), and owns the cache leaves it reads and
writes, made on its rank and never moved. `generate` prefills each group with
the same step over its prompts, then decodes one token per sequence a round in
the wavefront of `generate.wavefront` (groups in flight, sampling, stop tokens,
budgets, multi-process), so only activations and sampled tokens cross ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from spectrax_core.models import Sampler, gen_state

from .._mesh import as_mpmd_mesh
from .._trace.context import methods_outside_context_mesh
from ..errors import MpmdError
from .generate.links import Transfers, make_links
from .generate.requests import Request, check_request
from .generate.rows import row_state
from .generate.serve import Queue, serve_cells
from .generate.stages import StageLayout
from .generate.stepcells import serve_program, stage_program, step_cell
from .generate.stepgroups import Places, serve_groups, step_groups, step_input_specs
from .generate.traced import StepSplit, abstract, trace_step
from .generate.wavefront import generate_tokens, run_wavefront

NAME = "StepDecoder"


@methods_outside_context_mesh
class StepDecoder:
    """Generation across pipeline ranks with a decode step `step(params, cache, tokens, positions)`
    `-> (logits, cache)` holding `sxstage_iter` markers, and its cache maker `init_cache(batch, max_len)`.

    `tokens` and `positions` are `(batch, length)` int32: one token per
    sequence while decoding, the prompts (padded on the right) while
    prefilling; `logits` `(batch, length, vocab)`. Every cache leaf has the
    batch as its leading axis, and the step writes the entry of a token at its
    position (a query at position p must see only entries at positions <= p).
    """

    def __init__(self, step: Callable, params, init_cache: Callable, *, mesh, schedule=None):
        mesh = as_mpmd_mesh(mesh)
        self.step, self.init_cache, self.params = step, init_cache, params
        self.n_stages = mesh.mpmd_dim * (schedule.virtual_stages if schedule is not None else 1)
        self._layout = StageLayout.of(mesh, self.n_stages, schedule)
        self._links = make_links(self._layout, self.n_stages)
        self._moves = None  # the cross-process transfers (False: none), made at the first generation
        self._places = Places(self._layout, params, init_cache)
        self._plans: dict[tuple, StepSplit] = {}  # (group size, chunk length, max_len) -> its split
        self._programs: dict[tuple, tuple] = {}  # (size, prompt length, max_len, sampler, pad_id) -> programs

    def update(self, params) -> StepDecoder:
        """Use `params` (new values of the same structure, shapes and dtypes) from now on; the compiled
        programs are reused and leaves already on their stage's rank are used where they are."""
        if abstract(params) != abstract(self.params) or jax.tree.structure(params) != jax.tree.structure(
            self.params
        ):
            raise MpmdError(
                f"{NAME}.update: params differ from the decoder's in structure, shapes or dtypes; update "
                "takes new values of the same model. Build a new StepDecoder for another model."
            )
        self.params = params
        self._places.use(params)
        return self

    def weights(self) -> tuple:
        """Each stage's params (the leaves it reads) on its rank, as placed by the generations so far."""
        placed = self._places.placed
        return tuple([placed[k] for k in sorted(placed) if k[0] == s] for s in range(self.n_stages))

    def split(self, size: int, length: int, max_len: int) -> StepSplit:
        """The step cut into stages for groups of `size`, chunks of `length`, caches of `max_len`."""
        key = (size, length, max_len)
        if key not in self._plans:
            cache = jax.eval_shape(lambda: self.init_cache(size, max_len))
            ints = jax.ShapeDtypeStruct((size, length), jnp.int32)
            self._plans[key] = trace_step(
                self.step, abstract(self.params), cache, ints, ints, self.n_stages, NAME
            )
        return self._plans[key]

    def generate(
        self,
        prompts,
        max_new_tokens,
        *,
        groups: int = 1,
        lengths=None,
        max_len: int | None = None,
        sampler: Sampler = Sampler(),
        keys=None,
        stop_tokens: Sequence[int] = (),
        pad_id: int = 0,
        record: list | None = None,
    ) -> jax.Array:
        """New tokens `(batch, T)` after each prompt.

        `prompts`: a list of token lists (any lengths) or an int array
        `(batch, length)` (left-padded when `lengths` is given). The batch is
        split into `groups` groups decoded as a wavefront (`groups >= ranks`
        keeps every rank busy). `max_new_tokens` (an int or one per sequence),
        `sampler`, `keys` (one per sequence), `stop_tokens`, `pad_id` and
        `record` are `PipelineDecoder.generate`'s; `max_len` the cache
        positions (default: the longest prompt plus new tokens).
        """
        req = check_request(prompts, lengths, max_new_tokens, max_len, groups, pad_id, f"{NAME}.generate")
        transfers = self._transfers()
        if record is not None and transfers is not None:
            raise MpmdError(f"{NAME}.generate: record= measures a one-process run; drop it here.")
        state = row_state(gen_state(req.tokens.shape[0], req.budgets, keys, stop_tokens))
        pre, dec = self._stage_programs(req, sampler, pad_id)
        placed = step_groups(
            self._layout, self.n_stages, req, state, self._places.caches(dec[1], req.size, req.max_len)
        )
        cells = [
            step_cell(s, self.n_stages, pre[0][s], dec[0][s], self._places.weights(s, pre[1][s]))
            for s in range(self.n_stages)
        ]
        specs = None
        if transfers is not None:
            cache = jax.eval_shape(lambda: self.init_cache(req.size, req.max_len))
            specs = step_input_specs(
                req, pre, dec, abstract(jax.tree.leaves(self.params)), jax.tree.leaves(cache)
            )
            transfers.begin(req.groups, req.steps)
        return generate_tokens(
            cells,
            self._layout,
            placed,
            req.steps,
            pad_id,
            batch=req.tokens.shape[0],
            links=self._links,
            specs=specs,
            transfers=transfers,
            watch=transfers is None and len(stop_tokens) > 0,
            record=record,
        )

    def serve(
        self,
        prompts,
        max_new_tokens,
        *,
        batch: int,
        groups: int = 1,
        max_len: int | None = None,
        sampler: Sampler = Sampler(),
        keys=None,
        stop_tokens: Sequence[int] = (),
        pad_id: int = 0,
    ) -> jax.Array:
        """New tokens `(len(prompts), T)` of a queue of prompts decoded `batch` at a time (continuous
        batching, one process): when a sequence ends, its row takes the next prompt (see
        `generate.serve`). `groups` splits the rows as in `generate`; the other arguments are its own,
        per prompt."""
        name = f"{NAME}.serve"
        req = check_request(prompts, None, max_new_tokens, max_len, 1, pad_id, name)
        if (
            not isinstance(batch, int)
            or not isinstance(groups, int)
            or min(batch, groups) < 1
            or batch % groups
        ):
            raise MpmdError(
                f"{name}: batch={batch!r} rows must be a positive int that groups={groups!r} divides."
            )
        if self._transfers() is not None:
            raise MpmdError(
                f"{name}: continuous batching runs in one process; use generate across processes."
            )
        queue = Queue(
            [row[:n] for row, n in zip(req.tokens, req.lengths)],
            req.budgets,
            groups,
            batch // groups,
            stop_tokens,
        )
        programs, index = self._serve_programs(batch // groups, req.max_len, sampler, pad_id)
        weights = [self._places.weights(s, index[s]) for s in range(self.n_stages)]
        caches = self._places.caches(
            self.split(batch // groups, 1, req.max_len).owned, batch // groups, req.max_len
        )
        state = gen_state(len(queue.prompts), req.budgets, keys, stop_tokens)
        placed = serve_groups(
            self._layout, self.n_stages, state, groups, batch // groups, caches, queue.bound()
        )
        cells = serve_cells(programs, weights, queue, self._layout, pad_id)
        out = run_wavefront(cells, self._layout, placed, queue.bound(), pad_id, links=self._links, specs=None)
        return jnp.asarray(queue.tokens(out, batch // groups, pad_id))

    def _serve_programs(self, size: int, max_len: int, sampler, pad_id: int) -> tuple:
        key = ("serve", size, max_len, sampler, pad_id)
        if key not in self._programs:
            plan = self.split(size, 1, max_len)
            programs = [serve_program(plan, s, plan.params[s], sampler, pad_id) for s in range(self.n_stages)]
            self._programs[key] = (programs, plan.params)
        return self._programs[key]

    def _stage_programs(self, req: Request, sampler, pad_id: int) -> tuple:
        """`((programs, weight indices) for prefill, (programs, cache owned) for decode)` per stage."""
        key = (req.size, req.tokens.shape[1], req.max_len, sampler, pad_id)
        if key not in self._programs:
            first = self.split(req.size, req.tokens.shape[1], req.max_len)
            then = self.split(req.size, 1, req.max_len)
            if first.owned != then.owned:
                raise MpmdError(
                    f"{NAME}: the step's stages own different cache leaves over a prompt than over one token "
                    f"({first.owned} vs {then.owned}); keep each cache update between the same markers "
                    "whatever the length."
                )
            index = tuple(tuple(sorted(set(a) | set(b))) for a, b in zip(first.params, then.params))
            pre = [stage_program(first, s, index[s], True, sampler, pad_id) for s in range(self.n_stages)]
            dec = [stage_program(then, s, index[s], False, sampler, pad_id) for s in range(self.n_stages)]
            self._programs[key] = ((pre, index), (dec, then.owned))
        return self._programs[key]

    def _transfers(self) -> Transfers | None:
        """The cross-process moves, when a link between stages crosses processes (made once)."""
        if self._moves is None:
            self._moves = Transfers(self._links) if any(link.cross for link in self._links) else False
        return self._moves or None
