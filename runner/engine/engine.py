"""The engine: a pool of KV pages (models/paged.py) and one ragged step that decodes every live
row and prefills a chunk of a waiting prompt together.

Rows are `batch_size` places for sequences, split into G groups, one per shard of the batch (a
group's rows, tokens and pages stay on its devices); a row holds pages, not a reservation of
`max_prompt_len + max_new_tokens` slots, so the pool's size, not the worst case, bounds how many
rows run. Each call runs one program of two kinds, each compiled once:
- `mixed` (one per chunk bucket C): tokens [G, R + C], the R rows' next tokens (padding for rows
  not decoding) and a chunk of C prompt tokens of one row per group, in one forward pass;
- `decode`: tokens [G, R], `steps_per_dispatch` decode steps, each sampled token fed to the next,
  ending early when a row stops and a sample waits for its place.
The host (runner/engine/scheduler.py) owns every row's state, its pages and their tables,
and passes them with each call: nothing of a row lives on the device but its keys and values.
Sampling is runner/engine/sampling.py's, a row's key its seed folded with its count of tokens,
so a row's tokens do not depend on its neighbours, on how its prompt was chunked, or on whether
it was preempted and recomputed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import Output
from models.paged import PagedCache
from models.policy import Policy
from models.registry import Model
from runner.engine import hugepages
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


class Step(NamedTuple):
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


@dataclasses.dataclass(frozen=True)
class Pools:
    """A group's page pools (a device holds its group's pages, of its share of the kv heads): the
    full-attention layers' `pages` and the windowed layers' `window_pages`, room for every row's
    `window_row_pages` at once (0 without windows); a page's bytes on a device in each."""

    pages: int
    window_pages: int
    window_row_pages: int
    page_bytes: int
    window_page_bytes: int

    @property
    def bytes(self) -> int:
        """The pools' bytes on a device."""
        return self.pages * self.page_bytes + self.window_pages * self.window_page_bytes


def size_pools(model: Model, rules: Rules, kv_cache, rows: int, max_len: int, page_size: int,
               reach: int, kv_bytes: int = 0, pages: int = 0) -> Pools:
    """The pools of a group of `rows` rows, in the `kv_cache` dtype, as the Engine sizes them (and
    runner/tools/memory.py reports them): the full-attention layers' `pages` if given, else what
    kv_bytes (a device's) leaves beside the window pool, else room for every row at its longest
    (max_len tokens). Windowed layers: each row holds the pages its next call's queries can see,
    at most window - 1 + reach (the largest chunk, or a decode call's steps) positions back from
    the end, plus the page that starts part-way: enough for every row at once."""
    windows, kv_heads, head_dim = model.module.cache_spec(model.config)
    window = max((w for w in windows if w), default=0)  # the windowed layers' (one)
    windowed = sum(1 for w in windows if w)
    page = partial(PagedCache.page_bytes, kv_heads=kv_heads, head_dim=head_dim,
                   page_size=page_size, dtype=kv_cache, rules=rules)
    full_bytes, window_bytes = page(len(windows) - windowed), page(windowed)
    row_pages = -(-(window - 1 + reach) // page_size) + 2 if window else 0
    if kv_bytes and not pages:
        pages = int((kv_bytes - rows * row_pages * window_bytes) // full_bytes)
    elif not pages:
        pages = rows * -(-max_len // page_size)
    return Pools(pages, rows * row_pages, row_pages, full_bytes, window_bytes)


MAX_STOP_IDS = 16  # stop ids are passed as a fixed-size array, so their number never recompiles


class Weights(NamedTuple):
    """What every program reads: the prepared params, and the greedy screen (an int8 copy of the
    unembedding that greedy tokens come through where the backend has one, else None)."""

    params: Any
    greedy_screen: Any


@dataclasses.dataclass(frozen=True)
class Layout:
    """The shapes an engine's calls fill, which the scheduler plans with: B = groups x
    rows_per_group rows, each group's pool of `pages` pages of `page_size` tokens (and
    `window_pages` for the windowed layers' pool), a row's table of max_pages entries."""

    groups: int
    rows_per_group: int
    max_prompt_len: int
    max_new_tokens: int
    page_size: int
    pages: int  # the full-attention layers' pages per group
    window: int  # the windowed layers' window (0: none)
    window_pages: int  # the windowed layers' pages per group
    steps: int  # steps of a decode call
    chunks: tuple[int, ...]  # the chunk buckets, ascending
    step_tokens: int  # what a step costs besides its tokens, in tokens (Backend.step_tokens)
    vocab_size: int

    @property
    def batch_size(self) -> int:
        return self.groups * self.rows_per_group

    @property
    def max_len(self) -> int:
        return self.max_prompt_len + self.max_new_tokens

    @property
    def max_pages(self) -> int:
        """A table's entries: one request's longest."""
        return -(-self.max_len // self.page_size)

    @property
    def chunk(self) -> int:
        return self.chunks[-1]

    @property
    def mask_words(self) -> int:
        """int32 words of a row's token mask: one bit per id of the vocabulary."""
        return (self.vocab_size + 31) // 32

    def program(self, chunk: int, steps: int, logprobs: bool = False, masked: bool = False,
                prompt_logprobs: bool = False) -> Program:
        """The program a call of this shape runs."""
        return Program(chunk, 1 if chunk else steps, logprobs, masked, prompt_logprobs)

    def empty_step(self, chunk: int) -> Step:
        """Host arrays of a call with `chunk` chunk tokens (0: decode only) in which nothing
        happens: every token padding, every row idle."""
        G, R, M, B = self.groups, self.rows_per_group, self.max_pages, self.batch_size
        T = R + chunk
        rows = np.broadcast_to(np.concatenate([np.arange(R), np.zeros(chunk, int)]), (G, T))
        return Step(np.zeros((G, T), np.int32), np.full((G, T), -1, np.int32),
                    rows.astype(np.int32).copy(), np.zeros((G, T), np.int32),
                    np.zeros((G, R, M), np.int32), np.zeros((G, R, M), np.int32),
                    np.broadcast_to(np.arange(R, dtype=np.int32), (G, R)).copy(),
                    np.zeros(G, bool), np.zeros(B, bool), np.zeros(B, np.int32), np.ones(B, np.int32),
                    np.zeros(B, np.uint32), np.zeros(B, np.float32), np.zeros(B, np.int32),
                    np.ones(B, np.float32))


def goes_on(i, steps: int, started, live, refill, xp=np):
    """Whether a decode call runs its step i, given which rows sampled at its start (`started`
    [B]) and are still live ([B]): while i < steps and a row is live, unless a row has stopped
    in a group whose `refill` [G] is set (a sample waits for its place, which it takes at once
    rather than idling to the end of the call). The device's loop and the plan's stand-in both
    end a call by this; xp: jax.numpy or numpy."""
    ended = (started & ~live).reshape(refill.shape[0], -1)
    return (i < steps) & xp.any(live) & ~xp.any(ended & refill[:, None])


class Runner(Protocol):
    """What the scheduler (runner/engine/scheduler.py) asks of an engine: the Engine, and
    runner/tools/simulate.py's stand-in, whose calls compute nothing."""

    layout: Layout
    programs: set[str]  # the programs called so far, by name
    compile_wait_s: float  # calls' time waiting for their programs' compilation

    def prepare(self, programs: Sequence[Program]) -> None:
        """Begins compiling `programs`, in that order, while calls run."""

    def forget_prepared(self) -> None:
        """Drops the prepared programs whose compilation has not begun."""

    def call(self, step: Step, stop_ids: Sequence[int] = (), steps: int = 1, logprobs: bool = False,
             masks: np.ndarray | None = None, prompt_logprobs: bool = False
             ) -> tuple[np.ndarray, TokenLogprobs | None, TokenLogprobs | None]:
        """Runs one call: the tokens [B, steps] (-1 where a row did not sample), with logprobs
        their TokenLogprobs [B, steps], with prompt_logprobs the chunk's targets' [G, C]."""


class Engine:
    """The page pool and its programs, for one model on one mesh (a Runner)."""

    def __init__(self, model: Model, params, rules: Rules, policy: Policy, batch_size: int,
                 max_prompt_len: int, max_new_tokens: int, page_size: int, kv_bytes: int = 0,
                 steps_per_dispatch: int = 8, chunk: int = 256, allocate: bool = True,
                 pages: int = 0):
        """kv_bytes: the pools' bytes per device (a device holds its group's pages, of its share
        of the kv heads), or `pages`: the full-attention layers' pages per group; neither gives
        every row room for its longest request unless it is that large. allocate=False: params
        are abstract (Model.abstract_params), and so is the engine until `load` gives it its
        weights; it can lower, and prepare, its programs meanwhile."""
        G = rules.shards("batch")
        R = -(-batch_size // G)
        self.model, self.params, self.rules, self.policy = model, params, rules, policy.on(rules)
        steps = max(1, min(steps_per_dispatch, max_new_tokens))
        chunks = chunk_buckets(min(chunk, max_prompt_len + max_new_tokens))
        windows, kv_heads, head_dim = model.module.cache_spec(model.config)
        window = max((w for w in windows if w), default=0)  # the windowed layers' (one)
        pools = size_pools(model, rules, policy.kv_cache, R, max_prompt_len + max_new_tokens,
                           page_size, max(chunks[-1], steps), kv_bytes, pages)
        pages, window_pages = pools.pages, pools.window_pages
        self.layout = L = Layout(G, R, max_prompt_len, max_new_tokens, page_size, pages, window,
                                 window_pages, steps, chunks, self.policy.backend.step_tokens,
                                 model.vocab_size)
        if pages < L.max_pages:
            raise ValueError(f"a pool of {pages} pages of {page_size} tokens holds fewer than "
                             f"one request of max_prompt_len + max_new_tokens = {L.max_len}")
        B = L.batch_size
        self.pools = pools
        kv_dtype = jnp.dtype(policy.kv_cache)
        # abstract until `load`; allocated by one program, compiled once, whenever it is taken
        self.cache = PagedCache.create(G, pages, window_pages, page_size, windows, kv_heads,
                                       head_dim, kv_dtype, rules, allocate=False,
                                       fold=PagedCache.fold(self.policy, kv_dtype, head_dim),
                                       period=model.scan_period if policy.scan_layers else 0)
        cache_sh = jax.tree.map(lambda x: x.sharding, self.cache)
        self._allocate = jax.jit(partial(jax.tree.map, lambda x: jnp.zeros(x.shape, x.dtype),
                                         self.cache), out_shardings=cache_sh)
        self.greedy_screen = greedy_screen(model, _shapes(params), self.policy, B)
        self._huge_pages = None
        self._everywhere = everywhere = rules.sharding()
        self._step_sh = Step(*[rules.sharding("batch", None)] * 4,
                             *[rules.sharding("batch", None, None)] * 2, rules.sharding("batch", None),
                             *[rules.sharding("batch")] * 8)
        donate = (1,) if policy.donate_cache else ()
        self._step = jax.jit(self._step_fn, donate_argnums=donate,
                             compiler_options=self.policy.backend.compiler_options,
                             static_argnames=("steps", "logprobs", "prompt_logprobs"),
                             out_shardings=(everywhere, cache_sh, everywhere, everywhere))
        self._masks_sh = rules.sharding("batch", None, shape=(B, L.mask_words))
        self._stops: dict[tuple[int, ...], jax.Array] = {}
        # announce(name) -> a context manager around a wait for a program's compilation
        self.announce: Callable[[str], contextlib.AbstractContextManager] | None = None
        self.programs: set[str] = set()  # the programs called so far, by name
        # Prepared programs are traced and lowered on one thread, compiled (or loaded from the
        # compilation cache) on another: XLA releases the GIL while it compiles one program, so the
        # next one's Python tracing overlaps it rather than waiting behind it.
        self._lowered: dict[Program, Future] = {}  # lowered, or lowering on self._lowerer
        self._compiled: dict[Program, Future] = {}  # compiled, or compiling on self._compiler
        self.compile_wait_s = 0.0  # calls' time waiting for their programs' compilation
        self.compile_s: dict[Program, float] = {}  # each one's tracing, lowering and compilation
        self._lowerer = ThreadPoolExecutor(1, thread_name_prefix="podrun-lower")
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="podrun-compile")
        # the arguments' shapes, shardings and layouts (a lookup table's pinned row-major on TPU),
        # which a compilation on another thread reads while calls replace (and donate) the pool
        self._abstract = _shapes((self.weights, self.cache))
        if allocate:
            self.load(params)

    def load(self, params, pool: bool = True) -> None:
        """The engine on its weights: `params` (restored and prepared, Model.prepare) in place of
        the abstract ones it was built on (or of the weights it ran), the unembedding's screen
        made and, unless `pool` is False (then `allocate` does it), its pool allocated. The
        programs prepared meanwhile stay compiled when the weights have the shapes, dtypes,
        shardings and layouts they were lowered for, as Model.abstract_params declares them;
        where they do not (a warning), every program compiles again on the weights."""
        self.params = params
        if pool:
            self.allocate()
        self.greedy_screen = greedy_screen(self.model, params, self.policy, self.layout.batch_size)
        given = _shapes((self.weights, self.cache))
        if not _same(self._abstract, given):  # a bug in a declaration: slower, never wrong
            warnings.warn("podrun: the restored weights differ from Model.abstract_params's "
                          "declaration of them: the programs compile again", stacklevel=2)
            self.forget_prepared()
            self._compiled.clear()
            self._lowered.clear()
            self._abstract = given
        # (bytes on 2 MiB pages, bytes asked) of the weights and pool: CPU only, the
        # pages moved on a thread of their own while the programs compile and the first run
        if self.policy.backend.huge_pages:
            spans = hugepages.regions((self.params, self.cache, self.greedy_screen))
            self._huge_pages = ThreadPoolExecutor(1, thread_name_prefix="podrun-huge-pages").submit(
                hugepages.collapse_regions, spans)

    @property
    def allocated(self) -> bool:
        """Whether the pool is on the devices (not abstract, nor released)."""
        return isinstance(jax.tree.leaves(self.cache)[0], jax.Array)

    def release(self, pool: bool = True, weights: bool = False) -> None:
        """Hands the device memory of the pool, of the weights, or of both back: the engine keeps
        its compiled programs, and `load` (the pool alone: `allocate`) takes the memory again."""
        held = [self.cache] * pool + [self.params, self.greedy_screen] * weights
        for x in jax.tree.leaves(held):
            if isinstance(x, jax.Array):  # not what is abstract already
                x.delete()
        if pool:
            self.cache = self._abstract[1]
        if weights:
            self.params, self.greedy_screen = self._abstract[0]

    def allocate(self) -> None:
        """The pool on the devices again, after `release` (its contents do not matter: every
        page is written before it is read)."""
        if not self.allocated:
            self.cache = self._allocate()

    @property
    def huge_pages(self) -> tuple[int, int]:
        """(bytes on 2 MiB pages, bytes asked) of the weights and pool: CPU only."""
        return self._huge_pages.result() if self._huge_pages is not None else (0, 0)

    @property
    def weights(self) -> Weights:
        return Weights(self.params, self.greedy_screen)

    @property
    def greedy_screen_bytes(self) -> int:
        """Bytes of the greedy screen, which a greedy step reads in place of the unembedding (0:
        none)."""
        return sum(x.nbytes for x in jax.tree.leaves(self.greedy_screen))

    @property
    def output(self) -> Output:
        return Output.LOGITS if self.greedy_screen is None else Output.HIDDEN

    # --- device functions ---------------------------------------------------------------------

    def _forward(self, weights, cache: PagedCache, b: Step, logprobs: bool, masks,
                 prompt_logprobs: bool = False):
        """One step: the tokens through the model, then each row's next token from the hidden
        state of its `sample_at` token. Returns (next tokens [B], their TokenLogprobs or None,
        the pool, and with prompt_logprobs the chunk tokens' targets' TokenLogprobs [G, T - R])."""
        G, R = b.sample_at.shape
        out, cache = self.model.forward(weights.params, b.tokens, b.positions,
                                        cache.at(b.tables, b.window_tables, b.rows), self.rules,
                                        self.policy, Output.HIDDEN)
        prompt = None
        if prompt_logprobs:
            prompt = position_logprobs(self.model.unembedding(weights.params), out[:, R:],
                                       b.targets[:, R:], self.rules, self.policy)
        hidden = jnp.take_along_axis(out, b.sample_at[:, :, None], axis=1).reshape(G * R, -1)
        output = Output.LOGITS if logprobs else self.output
        if output is Output.LOGITS:
            hidden = self.model.unembedding(weights.params).logits(hidden[:, None], self.rules,
                                                                   self.policy)[:, 0]
        nxt = next_tokens(self.model, self.rules, self.policy, weights, hidden, output, b.seed,
                          b.count, b.temperature, b.top_k, b.top_p, masks)
        return nxt, token_logprobs(hidden, nxt) if logprobs else None, cache.pool(), prompt

    def _step_fn(self, weights, cache: PagedCache, b: Step, stop_ids, masks=None, steps: int = 1,
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
            return goes_on(carry[0], steps, b.live, carry[5], b.refill, jnp)

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
        """stop_ids as the fixed-size device array the programs take (-1 padding), made once per
        set."""
        key = tuple(stop_ids)
        if key not in self._stops:
            if len(key) > MAX_STOP_IDS:
                raise ValueError(f"{len(key)} stop ids; at most {MAX_STOP_IDS} are supported")
            stops = np.full((MAX_STOP_IDS,), -1, np.int32)
            stops[: len(key)] = key
            self._stops[key] = jax.device_put(stops, self._everywhere)
        return self._stops[key]

    def _lower(self, p: Program, platforms: tuple[str, ...] | None = None) -> jax.stages.Lowered:
        """Program p lowered for the mesh's devices (an AOT topology's too), or for `platforms`
        ("cuda": a GPU deployment's kernels, checked on a machine without one)."""
        shaped = lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        b = jax.tree.map(shaped, self.layout.empty_step(p.chunk), self._step_sh)
        stops = jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=self._everywhere)
        masks = (jax.ShapeDtypeStruct((self.layout.batch_size, self.layout.mask_words), jnp.int32,
                                      sharding=self._masks_sh) if p.masked else None)
        traced = self._step.trace(*self._abstract, b, stops, masks, steps=p.steps,
                                  logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs)
        return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

    def _timed_lower(self, p: Program) -> tuple[jax.stages.Lowered, float]:
        t0 = time.perf_counter()
        return self._lower(p), time.perf_counter() - t0

    def _compile(self, p: Program, lowered: Future | None = None) -> jax.stages.Compiled:
        """Program p compiled (or loaded from the compilation cache), from its lowering on the
        lowering thread where it has one; its time kept."""
        program, spent = lowered.result() if lowered is not None else self._timed_lower(p)
        self._lowered.pop(p, None)  # the lowered module is not kept beside its executable
        t0 = time.perf_counter()
        compiled = program.compile()
        self.compile_s[p] = spent + time.perf_counter() - t0
        return compiled

    def prepare(self, programs: Sequence[Program]) -> None:
        """Lowers, then compiles (or loads from the compilation cache) `programs` in that order,
        on threads of their own, while the calls run: a program's first call then waits only for
        what is left of its compilation. The tracing is Python's, which a running program
        leaves free."""
        for p in programs:
            if p not in self._compiled:
                self._lowered[p] = lowered = self._lowerer.submit(self._timed_lower, p)
                self._compiled[p] = self._compiler.submit(self._compile, p, lowered)

    def forget_prepared(self) -> None:
        """Drops the prepared programs whose lowering or compilation has not begun (a job that
        ended)."""
        for p, future in list(self._compiled.items()):
            if future.cancel():
                del self._compiled[p]
                self._lowered.pop(p).cancel()  # a lowering begun runs on, its result dropped

    def executable(self, p: Program) -> jax.stages.Compiled:
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
            else:  # compiled here, from the lowering thread's work where it has begun
                lowered = self._lowered.pop(p, None)
                compiled = self._compile(p, lowered if lowered is not None and not lowered.cancel()
                                         else None)
                self._compiled[p] = future = Future()
                future.set_result(compiled)
        self.compile_wait_s += time.perf_counter() - began
        return compiled

    def call(self, step: Step, stop_ids: Sequence[int] = (), steps: int = 1,
             logprobs: bool = False, masks: np.ndarray | None = None, prompt_logprobs: bool = False
             ) -> tuple[np.ndarray, TokenLogprobs | None, TokenLogprobs | None]:
        """Runs one program on host arrays `step`: the tokens [B, steps] (-1 where a row did not
        sample), with logprobs their TokenLogprobs [B, steps], with prompt_logprobs the chunk
        tokens' targets' [G, C]."""
        p = self.layout.program(step.tokens.shape[1] - self.layout.rows_per_group, steps, logprobs,
                                masks is not None, prompt_logprobs)
        run = self.executable(p)
        self.programs.add(p.name)
        device = jax.tree.map(jax.device_put, step, self._step_sh)
        if masks is not None:
            masks = jax.device_put(masks, self._masks_sh)
        emitted, self.cache, scores, prompt = run(self.weights, self.cache, device,
                                                  self._stop_array(stop_ids), masks)
        host = lambda x: None if x is None else TokenLogprobs(*map(np.asarray, x))
        return np.asarray(emitted), host(scores), host(prompt)

    def lower(self, variants: bool = False, platforms: tuple[str, ...] | None = None
              ) -> dict[str, jax.stages.Lowered]:
        """Every program a job runs, lowered for the mesh's devices (an AOT topology too) or for
        `platforms`: the decode call and the mixed step of each chunk bucket; with variants, the
        decode call that also returns log-probabilities and the largest mixed step that returns
        the chunk's."""
        L = self.layout
        programs = [L.program(C, 1) for C in L.chunks] + [L.program(0, L.steps)]
        if variants:
            programs += [L.program(0, L.steps, logprobs=True),
                         L.program(L.chunk, 1, logprobs=True, prompt_logprobs=True)]
        return {p.name: self._lower(p, platforms) for p in programs}
