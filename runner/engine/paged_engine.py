"""The paged engine: a pool of KV pages (models/paged.py) and one ragged step that decodes every
live row and prefills a chunk of a waiting prompt together.

Rows are `batch_size` places for sequences, split into G groups, one per shard of the batch (a
group's rows, tokens and pages stay on its devices); a row holds pages, not a reservation of
`max_prompt_len + max_new_tokens` slots, so the pool's size, not the worst case, bounds how many
rows run. Each call runs one program of two kinds, each compiled once:
- `mixed` (one per chunk bucket C): tokens [G, R + C], the R rows' next tokens (padding for rows
  not decoding) and a chunk of C prompt tokens of one row per group, in one forward pass;
- `decode`: tokens [G, R], `steps_per_dispatch` decode steps, each sampled token fed to the next.
The host (runner/engine/paged_scheduler.py) owns every row's state, its pages and their tables,
and passes them with each call: nothing of a row lives on the device but its keys and values.
Sampling is runner/engine/sampling.py's, a row's key its seed folded with its count of tokens,
so a row's tokens do not depend on its neighbours, on how its prompt was chunked, or on whether
it was preempted and recomputed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
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
    live: jax.Array  # [B] bool: the row samples its next token in this call
    count: jax.Array  # [B] int32: tokens the row has generated
    max_tokens: jax.Array  # [B] int32
    seed: jax.Array  # [B] uint32
    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32


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
        every row room for its longest request, as an unpaged cache would."""
        if policy.scan_layers:
            raise ValueError("the paged engine runs unrolled layers: precision.scan_layers=False")
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
        self.cache = PagedCache.create(G, self.pages, self.window_pages, page_size, windows,
                                       kv_heads, head_dim, kv_dtype, rules, allocate)
        self.greedy_screen = greedy_screen(model, params, self.policy, B) if allocate else None
        # (bytes on 2 MiB pages, bytes asked) of the weights and pool: CPU only (Engine's)
        self.huge_pages = (hugepages.collapse((self.params, self.cache, self.greedy_screen))
                           if allocate and self.policy.backend.huge_pages else (0, 0))
        cache_sh = jax.tree.map(lambda x: x.sharding, self.cache)
        self._everywhere = everywhere = rules.sharding()
        self._batch_sh = Batch(*[rules.sharding("batch", None)] * 4,
                               *[rules.sharding("batch", None, None)] * 2, rules.sharding("batch", None),
                               *[rules.sharding("batch")] * 7)
        donate = (1,) if policy.donate_cache else ()
        self._step = jax.jit(self._step_fn, donate_argnums=donate,
                             compiler_options=self.policy.backend.compiler_options,
                             static_argnames=("steps", "logprobs", "prompt_logprobs"),
                             out_shardings=(everywhere, cache_sh, everywhere, everywhere))
        self._stops: dict[tuple[int, ...], jax.Array] = {}
        self.announce: Callable[[str], contextlib.AbstractContextManager] | None = None
        self.programs: set[str] = set()  # the programs called so far, by name

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
        """`steps` steps: the first of `b` as given, each later one (decode only) feeding every
        live row's token to it at the next position, until the row stops (a stop id, its
        max_tokens). Returns the tokens [B, steps] (-1 where a row did not sample), the pool,
        with logprobs their TokenLogprobs [B, steps], and with prompt_logprobs (one step) the
        chunk's targets' [G, T - R]."""
        G, R = b.sample_at.shape
        if steps == 1:
            nxt, scores, cache, prompt = self._forward(weights, cache, b, logprobs, masks,
                                                       prompt_logprobs)
            emitted = jnp.where(b.live, nxt, -1)[:, None]
            scores = None if scores is None else jax.tree.map(lambda x: x[:, None], scores)
            return emitted, cache, scores, prompt
        first_pos = b.positions[:, :R].reshape(G * R)

        def step(carry, _):
            cache, token, pos, count, live = carry
            positions = jnp.where(live, pos, -1).reshape(G, R)
            s = b._replace(tokens=token.reshape(G, R), positions=positions, live=live, count=count)
            nxt, scores, cache, _ = self._forward(weights, cache, s, logprobs, None)
            count = count + live
            stopped = jnp.isin(nxt, stop_ids) | (count >= b.max_tokens)
            return ((cache, jnp.where(live, nxt, token), pos + 1, count, live & ~stopped),
                    (jnp.where(live, nxt, -1), scores))

        carry = (cache, b.tokens[:, :R].reshape(G * R), first_pos, b.count, b.live)
        (cache, *_), (emitted, scores) = jax.lax.scan(step, carry, None, length=steps)
        scores = None if scores is None else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), scores)
        return emitted.T, cache, scores, None

    # --- host side ----------------------------------------------------------------------------

    def _stop_array(self, stop_ids: Sequence[int]) -> jax.Array:
        return stop_array(self._stops, stop_ids, self._everywhere)

    def program(self, chunk: int, steps: int, logprobs: bool = False, masked: bool = False,
                prompt_logprobs: bool = False) -> str:
        """The name of the program a call of this shape runs."""
        name = f"mixed_{chunk}" if chunk else f"decode_{steps}"
        return (name + ("_logprobs" if logprobs else "") + ("_masked" if masked else "")
                + ("_prompt_logprobs" if prompt_logprobs else ""))

    def call(self, batch: Batch, stop_ids: Sequence[int] = (), steps: int = 1,
             logprobs: bool = False, masks: np.ndarray | None = None, prompt_logprobs: bool = False
             ) -> tuple[np.ndarray, TokenLogprobs | None, TokenLogprobs | None]:
        """Runs one program on host arrays `batch`: the tokens [B, steps] (-1 where a row did not
        sample), with logprobs their TokenLogprobs [B, steps], with prompt_logprobs the chunk
        tokens' targets' [G, C]."""
        T = batch.tokens.shape[1]
        name = self.program(T - self.rows_per_group, steps, logprobs, masks is not None,
                            prompt_logprobs)
        device = jax.tree.map(jax.device_put, batch, self._batch_sh)
        if masks is not None:
            masks = jax.device_put(masks, self.rules.sharding("batch", None, shape=masks.shape))
        first = name not in self.programs and self.announce is not None
        self.programs.add(name)
        with self.announce(name) if first else contextlib.nullcontext():
            emitted, self.cache, scores, prompt = self._step(
                self.weights, self.cache, device, self._stop_array(stop_ids), masks, steps=steps,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs)
            emitted = np.asarray(emitted)
        host = lambda x: None if x is None else TokenLogprobs(*map(np.asarray, x))
        return emitted, host(scores), host(prompt)

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
                     np.zeros(B, bool), np.zeros(B, np.int32), np.ones(B, np.int32),
                     np.zeros(B, np.uint32), np.zeros(B, np.float32), np.zeros(B, np.int32),
                     np.ones(B, np.float32))

    def lower(self, variants: bool = False) -> dict[str, jax.stages.Lowered]:
        """Every program a job runs, lowered for the mesh's devices (an AOT topology too): the
        decode call and the mixed step of each chunk bucket; with variants, the decode call that
        also returns log-probabilities and the largest mixed step that returns the chunk's."""
        stops = jax.ShapeDtypeStruct((MAX_STOP_IDS,), jnp.int32, sharding=self._everywhere)

        def shaped(chunk):
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                self.empty_batch(chunk), self._batch_sh)

        out = {self.program(C, 1): self._step.lower(self.weights, self.cache, shaped(C), stops)
               for C in self.chunks}
        out[self.program(0, self.steps)] = self._step.lower(self.weights, self.cache, shaped(0),
                                                            stops, steps=self.steps)
        if variants:
            out[self.program(0, self.steps, logprobs=True)] = self._step.lower(
                self.weights, self.cache, shaped(0), stops, steps=self.steps, logprobs=True)
            C = self.chunk
            out[self.program(C, 1, logprobs=True, prompt_logprobs=True)] = self._step.lower(
                self.weights, self.cache, shaped(C), stops, logprobs=True, prompt_logprobs=True)
        return out
