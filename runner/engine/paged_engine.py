"""The paged engine: a pool of KV pages (models/paged.py) and one ragged step that decodes every
live row and prefills a chunk of a waiting prompt together.

Rows are `batch_size` places for sequences, split into G groups, one per shard of the batch (a
group's rows, tokens and pages stay on its devices); a row holds pages, not a reservation of
`max_prompt_len + max_new_tokens` slots, so the pool's size, not the worst case, bounds how many
rows run. Each call runs one program of two kinds, each compiled once:
- `mixed` (one per chunk bucket C): tokens [G, R + C], the R rows' next tokens (padding for rows
  not decoding) and a chunk of C prompt tokens of one row per group, in one forward pass;
- `decode`: tokens [G, R], `steps_per_dispatch` decode steps, each sampled token fed to the next,
  ending early when a row stops and a sample waits for its place.
The host (runner/engine/paged_scheduler.py) owns every row's state, its pages and their tables,
and passes them with each call: nothing of a row lives on the device but its keys and values.
Sampling is runner/engine/sampling.py's, a row's key its seed folded with its count of tokens,
so a row's tokens do not depend on its neighbours, on how its prompt was chunked, or on whether
it was preempted and recomputed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import Mode, Output
from models.paged import PagedCache
from models.policy import Policy
from models.registry import Model
from runner.engine import hugepages
from runner.engine.engine import MAX_STOP_IDS, Weights, stop_array
from runner.engine.sampling import (TokenLogprobs, greedy_screen, next_tokens, position_logprobs,
                                    token_logprobs)
from sharding.rules import Rules


class Program(NamedTuple):
    """A program of the engine, by what sets its shapes: a mixed step of `chunk` chunk tokens
    (one step), or a decode call (chunk 0) of `steps` steps; and what it returns besides."""

    chunk: int
    steps: int
    logprobs: bool = False
    masked: bool = False  # each row's allowed tokens, from the host
    prompt_logprobs: bool = False

    @property
    def name(self) -> str:
        return ((f"mixed_{self.chunk}" if self.chunk else f"decode_{self.steps}")
                + "_logprobs" * self.logprobs + "_masked" * self.masked
                + "_prompt_logprobs" * self.prompt_logprobs)


class Batch(NamedTuple):
    """One call's input, from the host: a step's tokens [G, T] and where they go, and each of
    the B = G * R rows' sampling state [B]. Tokens [0, R) of a group are its rows' next tokens,
    one per row (position -1 where a row does not decode); tokens from R on, a chunk of one row's
    prompt (models/paged.py's layout)."""

    tokens: jax.Array  # [G, T] int32
    positions: jax.Array  # [G, T] int32, -1: padding
    rows: jax.Array  # [G, T] int32: the row (of its group) each token belongs to
    targets: jax.Array  # [G, T] int32: each chunk token's next token (for prompt log-probabilities)
    tables: jax.Array  # [G, R, M] int32: each row's pages
    window_tables: jax.Array  # [G, R, M] int32: each row's pages of the windowed layers' pool
    sample_at: jax.Array  # [G, R] int32: the token after which each row samples
    refill: jax.Array  # [G] bool: a sample waits for a row of the group (a decode call ends early)
    live: jax.Array  # [B] bool: the row samples its next token in this call
    count: jax.Array  # [B] int32: tokens the row has generated
    max_tokens: jax.Array  # [B] int32
    seed: jax.Array  # [B] uint32
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32


def _shapes(tree):
    """Each array's shape, dtype, sharding and layout, as a program is lowered for them."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.format), tree)


def _same(declared, given) -> bool:
    """Whether arrays `given` (_shapes) can run programs lowered for `declared`: the same tree,
    shapes, dtypes and shardings, and the same layouts where `declared` names one."""
    if jax.tree.structure(declared) != jax.tree.structure(given):
        return False

    def fits(d, g) -> bool:
        layout = d.format.layout
        return (d.shape == g.shape and d.dtype == g.dtype
                and d.sharding.is_equivalent_to(g.sharding, len(d.shape))
                and (layout is None or layout == g.format.layout))
    return all(map(fits, jax.tree.leaves(declared), jax.tree.leaves(given)))


def chunk_buckets(chunk: int, smallest: int = 16) -> tuple[int, ...]:
    """Chunk lengths a step pads a prompt's chunk to: the chunk, a quarter of it, ... down to
    `smallest` (256: 16, 64, 256), so a short prompt (or a long one's last chunk) never pays for
    a whole chunk, for a few programs."""
    out = [chunk]
    while out[-1] // 4 >= smallest:
        out.append(out[-1] // 4)
    return tuple(sorted(out))


class PagedEngine:
    """The device side of the paged engine: the page pool and its programs, for one model on one
    mesh."""

    def __init__(self, model: Model, params, rules: Rules, policy: Policy, batch_size: int,
                 max_prompt_len: int, max_new_tokens: int, page_size: int, kv_bytes: int = 0,
                 steps_per_dispatch: int = 8, chunk: int = 256, allocate: bool = True,
                 pages: int = 0):
        """kv_bytes: the pools' bytes per device (a device holds its group's pages, of its share
        of the kv heads), or `pages`: the full-attention layers' pages per group; neither gives
        every row room for its longest request, as an unpaged cache would. allocate=False: params
        are abstract (Model.abstract_params), and so is the engine until `load` gives it its
        weights; it can lower, and prepare, its programs meanwhile."""
        self.groups = G = rules.shards("batch")
        self.batch_size = B = -(-batch_size // G) * G
        self.rows_per_group = R = B // G
        self.model, self.params, self.rules, self.policy = model, params, rules, policy.on(rules)
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.max_len = max_prompt_len + max_new_tokens
        self.page_size = page_size
        self.max_pages = M = -(-self.max_len // page_size)  # a table's entries
        self.steps = max(1, min(steps_per_dispatch, max_new_tokens))
        self.chunks = chunk_buckets(min(chunk, max_prompt_len + max_new_tokens))
        self.chunk = self.chunks[-1]
        windows, kv_heads, head_dim = model.module.cache_spec(model.config)
        self.window = max((w for w in windows if w), default=0)  # the windowed layers' (one)
        # Windowed layers: each row holds the pages its next call's queries can see, at most
        # window - 1 + chunk (or steps) positions back from the end, plus the page that starts
        # part-way: enough for every row at once.
        self.window_pages = (R * (-(-(self.window - 1 + max(self.chunk, self.steps)) // page_size) + 2)
                             if self.window else 0)
        page = partial(PagedCache.page_bytes, kv_heads=kv_heads, head_dim=head_dim,
                       page_size=page_size, dtype=policy.kv_cache, rules=rules)
        windowed = sum(1 for w in windows if w)
        self.pages = pages or R * M
        if kv_bytes and not pages:
            self.pages = int((kv_bytes - self.window_pages * page(windowed)) // page(len(windows) - windowed))
        if self.pages < M:
            raise ValueError(f"a pool of {self.pages} pages of {page_size} tokens holds fewer than "
                             f"one request of max_prompt_len + max_new_tokens = {self.max_len}")
        # the pools' bytes on a device
        self.pool_bytes = self.pages * page(len(windows) - windowed) + self.window_pages * page(windowed)
        kv_dtype = jnp.dtype(policy.kv_cache)
        self._new_cache = partial(PagedCache.create, G, self.pages, self.window_pages, page_size,
                                  windows, kv_heads, head_dim, kv_dtype, rules,
                                  fold=PagedCache.fold(self.policy, kv_dtype, head_dim),
                                  period=model.scan_period if policy.scan_layers else 0)
        # abstract until `load`
        self.cache = self._new_cache(allocate=False)
        self.greedy_screen = greedy_screen(model, _shapes(params), self.policy, B)
        self._huge_pages = None
        cache_sh = jax.tree.map(lambda x: x.sharding, self.cache)
        self._everywhere = everywhere = rules.sharding()
        self._batch_sh = Batch(*[rules.sharding("batch", None)] * 4,
                               *[rules.sharding("batch", None, None)] * 2, rules.sharding("batch", None),
                               *[rules.sharding("batch")] * 8)
        donate = (1,) if policy.donate_cache else ()
        self._step = jax.jit(self._step_fn, donate_argnums=donate,
                             compiler_options=self.policy.backend.compiler_options,
                             static_argnames=("steps", "logprobs", "prompt_logprobs"),
                             out_shardings=(everywhere, cache_sh, everywhere, everywhere))
        self._masks_sh = rules.sharding("batch", None, shape=(B, self.mask_words))
        self._stops: dict[tuple[int, ...], jax.Array] = {}
        # announce(name) -> a context manager around a wait for a program's compilation
        self.announce: Callable[[str], contextlib.AbstractContextManager] | None = None
        self.programs: set[str] = set()  # the programs called so far, by name
        self._compiled: dict[Program, Future] = {}  # compiled, or compiling on self._compiler
        self.compile_wait_s = 0.0  # calls' time waiting for their programs' compilation
        self.compile_s: dict[Program, float] = {}  # each compilation's (or cache load's) own time
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="podrun-compile")
        # the arguments' shapes, shardings and layouts (a lookup table's pinned row-major on TPU),
        # which a compilation on another thread reads while calls replace (and donate) the pool
        self._abstract = _shapes((self.weights, self.cache))
        if allocate:
            self.load(params)

    def load(self, params) -> None:
        """The engine on its weights: `params` (restored and prepared, Model.prepare) in place of
        the abstract ones it was built on, its pool and the unembedding's screen allocated. The
        programs prepared meanwhile stay compiled when the weights have the shapes, dtypes,
        shardings and layouts they were lowered for, as Model.abstract_params declares them;
        where they do not (a warning), every program compiles again on the weights."""
        self.params = params
        self.cache = self._new_cache()
        self.greedy_screen = greedy_screen(self.model, params, self.policy, self.batch_size)
        given = _shapes((self.weights, self.cache))
        if not _same(self._abstract, given):  # a bug in a declaration: slower, never wrong
            warnings.warn("podrun: the restored weights differ from Model.abstract_params's "
                          "declaration of them: the programs compile again", stacklevel=2)
            self.forget_prepared()
            self._compiled.clear()
            self._abstract = given
        # (bytes on 2 MiB pages, bytes asked) of the weights and pool: CPU only (Engine's), the
        # pages moved on a thread of their own while the programs compile and the first run
        if self.policy.backend.huge_pages:
            spans = hugepages.regions((self.params, self.cache, self.greedy_screen))
            self._huge_pages = ThreadPoolExecutor(1, thread_name_prefix="podrun-huge-pages").submit(
                hugepages.collapse_regions, spans)

    @property
    def huge_pages(self) -> tuple[int, int]:
        """(bytes on 2 MiB pages, bytes asked) of the weights and pool: CPU only (Engine's)."""
        return self._huge_pages.result() if self._huge_pages is not None else (0, 0)

    @property
    def weights(self) -> Weights:
        return Weights(self.params, self.greedy_screen)

    @property
    def mask_words(self) -> int:
        return (self.model.vocab_size + 31) // 32

    @property
    def output(self) -> Output:
        return Output.LAST_LOGITS if self.greedy_screen is None else Output.LAST_HIDDEN

    # --- device functions ---------------------------------------------------------------------

    def _forward(self, weights, cache: PagedCache, b: Batch, logprobs: bool, masks,
                 prompt_logprobs: bool = False):
        """One step: the tokens through the model, then each row's next token from the hidden
        state of its `sample_at` token. Returns (next tokens [B], their TokenLogprobs or None,
        the pool, and with prompt_logprobs the chunk tokens' targets' TokenLogprobs [G, T - R])."""
        G, R = b.sample_at.shape
        out, cache = self.model.forward(weights.params, b.tokens, b.positions,
                                        cache.at(b.tables, b.window_tables, b.rows), self.rules,
                                        self.policy,
                                        Mode.APPEND, 0, Output.HIDDEN)
        prompt = None
        if prompt_logprobs:
            prompt = position_logprobs(self.model.unembedding(weights.params), out[:, R:],
                                       b.targets[:, R:], self.rules, self.policy)
        hidden = jnp.take_along_axis(out, b.sample_at[:, :, None], axis=1).reshape(G * R, -1)
        output = Output.LAST_LOGITS if logprobs else self.output
        if output is Output.LAST_LOGITS:
            hidden = self.model.unembedding(weights.params).logits(hidden[:, None], self.rules,
                                                                   self.policy)[:, 0]
        nxt = next_tokens(self.model, self.rules, self.policy, weights, hidden, output, b.seed,
                          b.count, b.temperature, b.top_k, b.top_p, masks)
        return nxt, token_logprobs(hidden, nxt) if logprobs else None, cache.pool(), prompt

    def _step_fn(self, weights, cache: PagedCache, b: Batch, stop_ids, masks=None, steps: int = 1,
                 logprobs: bool = False, prompt_logprobs: bool = False):
        """Up to `steps` steps: the first of `b` as given, each later one (decode only) feeding
        every live row's token to it at the next position, until the row stops (a stop id, its
        max_tokens). A call of several steps ends early once no row is live, or once a row of a
        group whose `refill` is set has stopped: its place goes to a waiting sample at once
        rather than idling to the end of the call. Returns the tokens [B, steps] (-1 where a row
        did not sample), the pool, with logprobs their TokenLogprobs [B, steps], and with
        prompt_logprobs (one step) the chunk's targets' [G, T - R]."""
        G, R = b.sample_at.shape
        if steps == 1:
            nxt, scores, cache, prompt = self._forward(weights, cache, b, logprobs, masks,
                                                       prompt_logprobs)
            emitted = jnp.where(b.live, nxt, -1)[:, None]
            scores = None if scores is None else jax.tree.map(lambda x: x[:, None], scores)
            return emitted, cache, scores, prompt
        B = G * R
        scores = None
        if logprobs:  # the shapes of a step's TokenLogprobs, to fill step by step
            scores = jax.tree.map(lambda x: jnp.zeros((steps, *x.shape), x.dtype), jax.eval_shape(
                lambda: token_logprobs(jnp.zeros((B, self.model.vocab_size)), jnp.zeros(B, jnp.int32))))

        def go_on(carry):
            i, live = carry[0], carry[5]
            ended = (b.live & ~live).reshape(G, R)
            return (i < steps) & jnp.any(live) & ~jnp.any(ended & b.refill[:, None])

        def step(carry):
            i, cache, token, pos, count, live, emitted, scores = carry
            positions = jnp.where(live, pos, -1).reshape(G, R)
            s = b._replace(tokens=token.reshape(G, R), positions=positions, live=live, count=count)
            nxt, got, cache, _ = self._forward(weights, cache, s, logprobs, None)
            count = count + live
            stopped = jnp.isin(nxt, stop_ids) | (count >= b.max_tokens)
            emitted = emitted.at[i].set(jnp.where(live, nxt, -1))
            if scores is not None:
                scores = jax.tree.map(lambda all_, x: all_.at[i].set(x), scores, got)
            return (i + 1, cache, jnp.where(live, nxt, token), pos + 1, count, live & ~stopped,
                    emitted, scores)

        carry = (jnp.int32(0), cache, b.tokens[:, :R].reshape(B), b.positions[:, :R].reshape(B),
                 b.count, b.live, jnp.full((steps, B), -1, jnp.int32), scores)
        _, cache, *_, emitted, scores = jax.lax.while_loop(go_on, step, carry)
        scores = None if scores is None else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), scores)
        return emitted.T, cache, scores, None

    # --- host side ----------------------------------------------------------------------------

    def _stop_array(self, stop_ids: Sequence[int]) -> jax.Array:
        return stop_array(self._stops, stop_ids, self._everywhere)

    def program(self, chunk: int, steps: int, logprobs: bool = False, masked: bool = False,
                prompt_logprobs: bool = False) -> Program:
        """The program a call of this shape runs."""
        return Program(chunk, 1 if chunk else steps, logprobs, masked, prompt_logprobs)

    def _lower(self, p: Program, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """Program p lowered for the mesh's devices (an AOT topology's too), or for `platforms`
        ("cuda": a GPU deployment's kernels, checked on a machine without one)."""
        shaped = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        b = jax.tree.map(shaped, self.empty_batch(p.chunk), self._batch_sh)
        stops = jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=self._everywhere)
        masks = (jax.ShapeDtypeStruct((self.batch_size, self.mask_words), jnp.int32,
                                      sharding=self._masks_sh) if p.masked else None)
        traced = self._step.trace(*self._abstract, b, stops, masks, steps=p.steps,
                                  logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs)
        return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    def _compile(self, p: Program) -> jax.stages.Compiled:
        t0 = time.perf_counter()
        compiled = self._lower(p).compile()
        self.compile_s[p] = time.perf_counter() - t0
        return compiled

    def prepare(self, programs: Sequence[Program]) -> None:
        """Compiles `programs` (or loads them from the compilation cache) one after another on a
        thread of their own, in that order, while the calls run: a program's first call then
        waits only for what is left of its compilation. The tracing is Python's, which a
        running program leaves free."""
        for p in programs:
            if p not in self._compiled:
                self._compiled[p] = self._compiler.submit(self._compile, p)

    def forget_prepared(self) -> None:
        """Drops the prepared programs whose compilation has not begun (a job that ended)."""
        for p, future in list(self._compiled.items()):
            if future.cancel():
                del self._compiled[p]

    def _executable(self, p: Program) -> jax.stages.Compiled:
        """Program p compiled: prepared, or compiled now (announced) when it was not, or when its
        compilation had not begun (then taken off the thread's queue). The time the call waits
        adds to compile_wait_s."""
        future = self._compiled.get(p)
        if future is not None and future.done():
            return future.result()
        began = time.perf_counter()
        with self.announce(p.name) if self.announce is not None else contextlib.nullcontext():
            if future is not None and not future.cancel():
                compiled = future.result()
            else:
                compiled = self._compile(p)
                self._compiled[p] = future = Future()
                future.set_result(compiled)
        self.compile_wait_s += time.perf_counter() - began
        return compiled

    def call(self, batch: Batch, stop_ids: Sequence[int] = (), steps: int = 1,
             logprobs: bool = False, masks: np.ndarray | None = None, prompt_logprobs: bool = False
             ) -> tuple[np.ndarray, TokenLogprobs | None, TokenLogprobs | None]:
        """Runs one program on host arrays `batch`: the tokens [B, steps] (-1 where a row did not
        sample), with logprobs their TokenLogprobs [B, steps], with prompt_logprobs the chunk
        tokens' targets' [G, C]."""
        p = self.program(batch.tokens.shape[1] - self.rows_per_group, steps, logprobs,
                         masks is not None, prompt_logprobs)
        run = self._executable(p)
        self.programs.add(p.name)
        device = jax.tree.map(jax.device_put, batch, self._batch_sh)
        if masks is not None:
            masks = jax.device_put(masks, self._masks_sh)
        emitted, self.cache, scores, prompt = run(self.weights, self.cache, device,
                                                  self._stop_array(stop_ids), masks)
        host = lambda x: None if x is None else TokenLogprobs(*map(np.asarray, x))
        return np.asarray(emitted), host(scores), host(prompt)

    def empty_batch(self, chunk: int) -> Batch:
        """Host arrays of a call with `chunk` chunk tokens (0: decode only) in which nothing
        happens: every token padding, every row idle."""
        G, R, M, B = self.groups, self.rows_per_group, self.max_pages, self.batch_size
        T = R + chunk
        rows = np.broadcast_to(np.concatenate([np.arange(R), np.zeros(chunk, int)]), (G, T))
        return Batch(np.zeros((G, T), np.int32), np.full((G, T), -1, np.int32),
                     rows.astype(np.int32).copy(), np.zeros((G, T), np.int32),
                     np.zeros((G, R, M), np.int32),
                     np.zeros((G, R, M), np.int32),
                     np.broadcast_to(np.arange(R, dtype=np.int32), (G, R)).copy(),
                     np.zeros(G, bool), np.zeros(B, bool), np.zeros(B, np.int32), np.ones(B, np.int32),
                     np.zeros(B, np.uint32), np.zeros(B, np.float32), np.zeros(B, np.int32),
                     np.ones(B, np.float32))

    def lower(self, variants: bool = False, platforms: tuple[str, ...] | None = None
              ) -> dict[str, jax.stages.Lowered]:
        """Every program a job runs, lowered for the mesh's devices (an AOT topology too) or for
        `platforms`: the decode call and the mixed step of each chunk bucket; with variants, the
        decode call that also returns log-probabilities and the largest mixed step that returns
        the chunk's."""
        programs = [self.program(C, 1) for C in self.chunks] + [self.program(0, self.steps)]
        if variants:
            programs += [self.program(0, self.steps, logprobs=True),
                         self.program(self.chunk, 1, logprobs=True, prompt_logprobs=True)]
        return {p.name: self._lower(p, platforms) for p in programs}
