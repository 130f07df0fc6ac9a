"""The generation engine: `batch_size` rows of a pre-allocated sharded KV cache that stay full.

Two kinds of device program, compiled once each and reused as requests come and go, the cache
donated to both:
- `insert`: R waiting prompts (R from a few fixed sizes), left-padded to one bucket, prefilled
  together into a cache of their own (after the blocks they share from the prefix pool, when
  they share any), then copied into R free rows of the engine's cache in place of whatever those
  rows held; their full blocks that the pool lacks are kept in it; their first tokens are sampled;
- `decode`: `steps_per_dispatch` decode steps of every row.
Each row keeps its own decode state (`Rows`: newest token, position, next cache column, count,
sampling settings): a row's prompt fills columns [0, P) of its row and its tokens follow, so rows
inserted at different times write different columns in the same step; positions (-1 for empty
columns and padding) drive RoPE and the masks. Sampling happens on device with a key per request
(its seed folded with its count of tokens), so a request's tokens depend on its seed alone, not
on its neighbours or on when it entered. The host loop that decides what goes where is
runner/engine/scheduler.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.decoder import Mode, Output
from models.kv_cache import KVCache
from models.policy import Policy
from models.registry import Model
from runner.engine import hugepages
from runner.engine.prefixes import PrefixIndex
from runner.engine.sampling import (  # noqa: F401 (re-exported: the engine's sampling)
    CANDIDATES, MAX_LOGPROBS, TokenLogprobs, allowed_tokens, greedy_screen, greedy_tokens,
    masked_greedy, next_tokens, nucleus, position_logprobs, sample, sample_seed, token_logprobs,
    unpacked)
from sharding.rules import Rules, fit

MAX_STOP_IDS = 16  # stop ids are passed as a fixed-size array, so their number never recompiles


@dataclasses.dataclass(frozen=True)
class Request:
    """One row to generate: prompt ids and per-request sampling settings. max_tokens 0 only
    prefills (a prompt scored, nothing generated). logprobs, prompt_logprobs: whether the
    completion carries each generated token's, or each prompt token's, log-probabilities."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: bool = False
    prompt_logprobs: bool = False
    prompt_logprobs_from: int = 1  # the first prompt token whose log-probability is wanted
    n: int = 1  # samples, drawn from one prefill where their rows are free together
    # A format the completion must follow: `start()` gives each sample a walk through it with
    # `mask(out)` (the next token's allowed ids, written as `allowed_tokens` reads them),
    # `take(token)` and `complete` (runner/text/structured.py). None: free text.
    constraint: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # stop | length
    ttft_s: float = 0.0  # from the request's prefill call to its first token on the host
    decode_s: float = 0.0  # from then to its last token on the host
    logprobs: list[TokenLogprobs] | None = None  # per generated token, when asked
    # per prompt token after the first; None for those a shared prefix left uncomputed
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # under a format: the tokens ended (max_tokens) before it was complete
    incomplete_format: bool = False


class Rows(NamedTuple):
    """The decode state of every row, [B] each, sharded like the batch: one pytree, passed to and
    returned by every call. A finished (or never filled) row is `done`: it emits -1 and writes no
    position."""

    token: jax.Array  # int32: the newest token, the next step's input
    pos: jax.Array  # int32: its position in its sequence
    column: jax.Array  # int32: the cache column it is written to
    count: jax.Array  # int32: tokens generated so far
    done: jax.Array  # bool
    max_tokens: jax.Array  # int32
    seed: jax.Array  # uint32
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32

    @staticmethod
    def dtypes() -> Rows:
        i, f = jnp.int32, jnp.float32
        return Rows(i, i, i, i, jnp.bool_, i, jnp.uint32, f, i, f)


class Weights(NamedTuple):
    """What every program reads: the prepared params and the greedy screen, an int8 copy of the
    unembedding that greedy tokens come through where the backend has one
    (Engine._make_greedy_screen), else None."""

    params: Any
    greedy_screen: Any


class Inserted(NamedTuple):
    """What `Engine.insert` gives back, row by row of its targets (request by request, each
    request's samples in turn): the first tokens, with logprobs their TokenLogprobs; and, with
    prompt_logprobs, per request the TokenLogprobs of its prompt tokens after the first (None
    for those in the blocks it shared)."""

    first: np.ndarray
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[list[TokenLogprobs | None]] | None = None


class Keep(NamedTuple):
    """Blocks of an insert's prompts for the prefix pool, [K] each: columns [starts[i],
    starts[i] + block) of prompt rows[i] into pool block blocks[i] (the pool's size or more:
    padding, dropped)."""

    rows: jax.Array
    starts: jax.Array
    blocks: jax.Array


class Prompts(NamedTuple):
    """R prompts for `insert`, each prefilled once into F rows (F samples of it): tokens and
    positions [R, P] (left-padded, -1 for padding); the rows they go into [R * F], prompt i's
    samples at i * F .. i * F + F - 1 (B or more: a padding entry, dropped), and the settings of
    each row [R * F]."""

    tokens: jax.Array
    positions: jax.Array
    rows: jax.Array
    max_tokens: jax.Array
    seed: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


def buckets(max_prompt_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest`, and from 64 on the midpoints between them too (16, 32, 64,
    96, 128, 192, 256, 384, ...), capped by (and ending at) the maximum prompt length: a prompt
    is padded by at most a third where padding costs most, for a few more programs."""
    out, b = [], smallest
    while b < max_prompt_len:
        out += [b, b * 3 // 2] if b >= 64 else [b]
        b *= 2
    return tuple(x for x in out if x < max_prompt_len) + (max_prompt_len,)


def stop_array(made: dict, stop_ids: Sequence[int], sharding) -> jax.Array:
    """stop_ids as the fixed-size device array the programs take (-1 padding), made once per set
    and kept in `made`."""
    key = tuple(stop_ids)
    if key not in made:
        if len(key) > MAX_STOP_IDS:
            raise ValueError(f"{len(key)} stop ids; at most {MAX_STOP_IDS} are supported")
        stops = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops[: len(key)] = key
        made[key] = jax.device_put(stops, sharding)
    return made[key]


# The fewest rows a job's last requests are gathered into (Engine.shrink): below about this many a
# decode step's cost is the weights' bytes whatever the rows, so fewer would save little and
# compile more programs.
TAIL_ROWS = 8


class Engine:
    """Continuous batching for one model on one mesh: `batch_size` rows of a KV cache, each refilled
    as its request finishes (runner/engine/scheduler.py). Its programs are compiled once per shape:
    `insert` per (rows, bucket) and one `decode`."""

    def __init__(self, model: Model, params, rules: Rules, policy: Policy, batch_size: int,
                 max_prompt_len: int, max_new_tokens: int, steps_per_dispatch: int = 8,
                 prefill_buckets: Sequence[int] = (), allocate: bool = True, prefill_rows: int = 0,
                 smallest_tail: int = TAIL_ROWS, prefix_tokens: int = 0, prefix_block: int = 16):
        """`params` may be abstract (ShapeDtypeStructs) with allocate=False: enough to `lower`.

        prefill_rows > 0 caps how many prompts one `insert` prefills together (their activations
        and attention scores take memory for those rows alone); 0 lets it take the whole batch.
        An insert takes 1, 2, 4, ... up to that many rows, so a few free rows never pay for a
        whole batch's prefill.
        smallest_tail: the fewest rows `shrink` gathers the last requests of a job into.
        prefix_tokens > 0 keeps that many prompt tokens' keys and values, in blocks of
        prefix_block, for prompts that start the same way (runner/engine/prefixes.py).
        """
        data = rules.shards("batch")
        self.batch_size = B = -(-batch_size // data) * data  # a whole number of rows per data shard
        self.rows = B  # the cache's rows now: fewer after `shrink`, until `reset`
        halves = (B >> k for k in range(1, B.bit_length()))
        self.tail_sizes = tuple(b for b in halves if b >= max(smallest_tail, 1) and b % data == 0)
        most = min(prefill_rows, B) if prefill_rows > 0 else B
        sizes = {most} | {1 << k for k in range(most.bit_length()) if 1 << k < most}
        self.insert_sizes = tuple(sorted(sizes))
        self.prefill_rows = most
        self.model, self.params, self.rules, self.policy = model, params, rules, policy.on(rules)
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.steps = max(1, min(steps_per_dispatch, max_new_tokens))
        self.buckets = tuple(sorted(prefill_buckets)) or buckets(max_prompt_len)
        if self.buckets[-1] < max_prompt_len:
            raise ValueError(f"prefill buckets {self.buckets} do not reach max_prompt_len={max_prompt_len}")
        # a row holds its prompt's bucket, then its tokens: the cache never wraps
        self.cache_len = self.buckets[-1] + max_new_tokens
        kv_dtype = jnp.dtype(policy.kv_cache)
        self._new_cache = partial(model.new_cache, dtype=kv_dtype, rules=rules,
                                  stacked=policy.scan_layers)
        cache_sh = model.cache_shardings(rules, kv_dtype == jnp.int8, policy.scan_layers)
        # The prefix pool: blocks of prompts' keys and values, every layer's (a windowed layer's
        # too, as the prefill computed it before its ring kept the last columns), one row each.
        self.prefix, self.pool, pool_sh = None, None, None
        if prefix_tokens >= prefix_block > 0:
            self.prefix = PrefixIndex(prefix_tokens // prefix_block, prefix_block)
            pool_sh = self._shaped(self.prefix.blocks, prefix_block, cache_sh, rings=False)
            self.pool = (self._new_cache(self.prefix.blocks, prefix_block, rings=False) if allocate
                         else pool_sh)
            pool_sh = jax.tree.map(lambda x: x.sharding, pool_sh)
        row = rules.sharding("batch", shape=(B,))
        rows_sh = Rows(*[row] * len(Rows._fields))
        everywhere = self._everywhere = rules.sharding()
        idle = Rows(*(jax.ShapeDtypeStruct((B,), dt, sharding=row) for dt in Rows.dtypes()))
        self._idle = jax.jit(lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), idle)
                             ._replace(done=jnp.ones((B,), bool)), out_shardings=rows_sh)
        if allocate:
            self.cache = self._new_cache(B, self.cache_len)
            self.state = self._idle()
        else:  # shapes with their shardings, so donation pairs the cache with the cache alone
            self.cache = self._shaped(B, self.cache_len, cache_sh)
            self.state = idle
        self.greedy_screen = self._make_greedy_screen() if allocate else None
        # (bytes on 2 MiB pages, bytes asked) of the weights and cache: CPU only, and only where
        # the system gives huge pages (Linux 6.1 on); (0, 0) when not asked
        self.huge_pages = (hugepages.collapse((self.params, self.cache, self.greedy_screen))
                           if allocate and self.policy.backend.huge_pages else (0, 0))
        # Every array crossing the jit boundary has a fixed sharding, so no call recompiles. What the
        # host reads back (tokens) is replicated, so every process of a multi-host run can read all
        # of it and take the same decisions.
        opts = self.policy.backend.compiler_options
        # The cache is updated in place, not copied. The rows' state (a few [B] arrays) is not
        # donated: aliasing it makes XLA:TPU keep temporaries larger than the cache itself.
        donate = (1,) if policy.donate_cache else ()
        # Variants that also return log-probabilities (static flags) compile only when a request
        # asks for them; those taking token masks (`masks` given, not None) only when a row
        # generates under a format. The prefix pool (argument 5) is updated in place too.
        self._insert = jax.jit(self._insert_fn, donate_argnums=donate + (5,), compiler_options=opts,
                               static_argnames=("logprobs", "prompt_logprobs"),
                               out_shardings=(everywhere, cache_sh, rows_sh, everywhere, pool_sh))
        self._decode = jax.jit(self._decode_fn, donate_argnums=donate, compiler_options=opts,
                               static_argnames=("logprobs",),
                               out_shardings=(everywhere, cache_sh, rows_sh, everywhere))
        self._gather = jax.jit(self._gather_fn, out_shardings=(cache_sh, rows_sh))
        self._stops: dict[tuple[int, ...], jax.Array] = {}
        # Called around a program's first call, which compiles it (or loads it from the
        # compilation cache): announce(what) -> a context manager, e.g. to show it on a progress bar.
        self.announce: Callable[[str], contextlib.AbstractContextManager] | None = None
        self._called: set[str] = set()

    def _first_call(self, what: str) -> contextlib.AbstractContextManager:
        if what in self._called or self.announce is None:
            return contextlib.nullcontext()
        self._called.add(what)
        return self.announce(what)

    def _shaped(self, rows: int, columns: int, shardings: KVCache, rings: bool = True) -> KVCache:
        """The shapes of a new cache of `rows` x `columns` (ShapeDtypeStructs), with `shardings`
        fitted to them."""
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                               sharding=fit(sh, x.shape)),
                            jax.eval_shape(lambda: self._new_cache(rows, columns, rings=rings)),
                            shardings)

    def _make_greedy_screen(self):
        return greedy_screen(self.model, self.params, self.policy, self.batch_size)

    @property
    def mask_words(self) -> int:
        """int32 words of a row's token mask: one bit per id of the vocabulary."""
        return (self.model.vocab_size + 31) // 32

    @property
    def weights(self) -> Weights:
        return Weights(self.params, self.greedy_screen)

    @property
    def greedy_screen_bytes(self) -> int:
        """Bytes of the greedy screen, which a greedy step reads in place of the unembedding (0:
        none)."""
        return sum(a.nbytes for a in jax.tree.leaves(self.greedy_screen))

    def _prompt_shardings(self, R: int, F: int = 1) -> Prompts:
        one, two = (self.rules.sharding("batch", shape=(R * F,)),
                    self.rules.sharding("batch", None, shape=(R, 1)))
        return Prompts(two, two, *[one] * (len(Prompts._fields) - 2))

    def lower(self, variants: bool = False, prefills: bool = True) -> dict[str, jax.stages.Lowered]:
        """Every function generation runs, lowered for the mesh's devices (which may be an AOT
        topology with no devices attached): per bucket P the insert of the most rows at once
        (`prefill_{P}`, the largest of its sizes; not with prefills=False) and the decode step
        (`decode`). With variants, also those that compile only when a request asks for them: the
        largest bucket's with the log-probabilities of every prompt token
        (`prefill_{P}_logprobs`), the decode step's (`decode_logprobs`) and, with prefix sharing,
        the smallest bucket's after the most columns shared from the pool
        (`prefill_{P}_after_{C}`)."""
        weights = self.weights
        everywhere = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._everywhere)
        stops = everywhere((MAX_STOP_IDS,))
        R = self.prefill_rows
        dtypes = (jnp.int32, jnp.int32, jnp.int32, jnp.int32, jnp.uint32, jnp.float32, jnp.int32,
                  jnp.float32)

        def insert(P: int, blocks: int = 0, **variant) -> jax.stages.Lowered:
            shapes = ((R, P), (R, P)) + ((R,),) * 6
            prompts = Prompts(*(jax.ShapeDtypeStruct(s, d, sharding=h)
                                for s, d, h in zip(shapes, dtypes, self._prompt_shardings(R))))
            K = R * (P // self.prefix.block) if self.prefix else 0
            keep = Keep(*[everywhere((K,))] * 3) if K else None
            shared = None if not blocks else jax.ShapeDtypeStruct(
                (R, blocks), jnp.int32, sharding=self.rules.sharding("batch", None, shape=(R, blocks)))
            return self._insert.lower(weights, self.cache, self.state, prompts, stops, self.pool,
                                      shared, keep, **variant)

        out = {f"prefill_{P}": insert(P) for P in self.buckets} if prefills else {}
        out["decode"] = self._decode.lower(weights, self.cache, self.state, stops)
        if variants:
            out["decode_logprobs"] = self._decode.lower(weights, self.cache, self.state, stops,
                                                        logprobs=True)
        if variants and prefills:
            P = self.buckets[-1]
            out[f"prefill_{P}_logprobs"] = insert(P, logprobs=True, prompt_logprobs=True)
            P = self.buckets[0]
            M = min((self.max_prompt_len - P) // self.prefix.block, self.prefix.blocks) if self.prefix else 0
            if M > 0:
                out[f"prefill_{P}_after_{M * self.prefix.block}"] = insert(P, M)
        return out

    # --- device functions ---------------------------------------------------------------------

    @property
    def output(self) -> Output:
        """What the programs' forward passes return: with a greedy screen the last hidden state,
        which `_next_tokens` unembeds, else the last logits."""
        return Output.LAST_LOGITS if self.greedy_screen is None else Output.LAST_HIDDEN

    def _next_tokens(self, weights, out, output, seeds, counts, temperature, top_k, top_p,
                     masks=None) -> jax.Array:
        return next_tokens(self.model, self.rules, self.policy, weights, out, output, seeds, counts,
                           temperature, top_k, top_p, masks)

    def _insert_fn(self, weights, cache: KVCache, state: Rows, new: Prompts, stop_ids,
                   pool: KVCache | None = None, blocks: jax.Array | None = None,
                   keep: Keep | None = None, logprobs: bool = False, prompt_logprobs: bool = False,
                   masks=None):
        """Prefills R prompts into a cache of their own, copies each into its F rows of `cache`
        and starts those rows' decode state at their first sampled token, each row's drawn with
        its own seed. The tokens given fill columns [0, P). With `blocks` [R, M], each prompt's
        first M blocks of `pool` (prefix sharing) fill columns [0, C = M * block) and the tokens
        given, the rest of the prompt, follow in columns [C, C + P). With `keep`, the blocks it
        names of the prompts' cache go into `pool`, which is returned. With logprobs, also the
        first tokens' TokenLogprobs [R * F]; with prompt_logprobs, each position's next token's
        [R, P - 1]. masks [R * F, W]: the tokens each row's first may be (`allowed_tokens`)."""
        (R, P), F = new.tokens.shape, new.rows.shape[0] // new.tokens.shape[0]
        C = 0 if blocks is None else blocks.shape[1] * self.prefix.block
        if C:  # the prompts' blocks, then empty columns for the rest
            fresh = jax.tree.map(lambda x: x[blocks.reshape(-1)], pool).joined(blocks.shape[1])
            fresh = fresh.extended(C + P)
        else:  # with a pool to fill, windowed layers keep every column until the rows take theirs
            fresh = self._new_cache(R, P, rings=pool is None)
        output = (Output.HIDDEN if prompt_logprobs else
                  Output.LAST_LOGITS if logprobs else self.output)
        out, fresh = self.model.forward(weights.params, new.tokens, new.positions, fresh, self.rules,
                                        self.policy, Mode.APPEND if C else Mode.PREFILL, C, output)
        if C and self.cache.ring_pos.shape[1]:
            # A window's ring takes a row's last W columns: the shared blocks move up to the rest
            # of the prompt, the padding between them goes before both.
            pad = jnp.sum(new.positions < 0, axis=1, keepdims=True)  # [R, 1]
            c = jnp.arange(C + P)
            fresh = fresh.reordered(jnp.where(c < pad, c + C, jnp.where(c < pad + C, c - pad, c)))
        if keep is not None:
            pool = pool.insert(fresh.columns(keep.rows, keep.starts, self.prefix.block), keep.blocks,
                               self.rules)
        scores = None
        if prompt_logprobs:
            unembedding = self.model.unembedding(weights.params)
            scores = self._prompt_logprobs(unembedding, out, new.tokens)
            out = unembedding.logits(out[:, -1:], self.rules, self.policy)[:, 0]
            output = Output.LAST_LOGITS
        positions = new.positions
        if F > 1:  # every prompt's prefill copied to its F rows
            src = jnp.repeat(jnp.arange(R), F)
            out, positions = out[src], positions[src]
            fresh = jax.tree.map(lambda x: x[src], fresh)
        first = self._next_tokens(weights, out, output, new.seed, jnp.zeros_like(new.top_k),
                                  new.temperature, new.top_k, new.top_p, masks)
        cache = cache.insert(fresh, new.rows, self.rules)
        started = Rows(token=first, pos=jnp.max(positions, axis=1) + 1,
                       column=jnp.full((R * F,), C + P, jnp.int32), count=jnp.ones((R * F,), jnp.int32),
                       done=jnp.isin(first, stop_ids) | (new.max_tokens <= 1),
                       max_tokens=new.max_tokens, seed=new.seed, temperature=new.temperature,
                       top_k=new.top_k, top_p=new.top_p)
        state = jax.tree.map(lambda x, y: x.at[new.rows].set(y.astype(x.dtype), mode="drop"),
                             state, started)
        extra = (token_logprobs(out, first) if logprobs else None, scores)
        return first, cache, state, extra, pool

    def _prompt_logprobs(self, unembedding, hidden: jax.Array, tokens: jax.Array) -> TokenLogprobs:
        """Each position's next prompt token's TokenLogprobs [R, P - 1], from the final norm's
        output hidden [R, P, D]."""
        return position_logprobs(unembedding, hidden[:, :-1], tokens[:, 1:], self.rules, self.policy)

    def _decode_fn(self, weights, cache: KVCache, state: Rows, stop_ids, logprobs: bool = False,
                   masks=None):
        """`self.steps` decode steps of every row: its newest token is written to its next column
        and the next one sampled. Finished rows write no position and emit -1. With logprobs,
        also every step's TokenLogprobs of the tokens taken [B, steps]. With masks [B, W] (the
        tokens each row may take, `allowed_tokens`), one step: the host gives the next masks."""
        output = Output.LAST_LOGITS if logprobs else self.output
        steps = self.steps if masks is None else 1

        def step(carry, _):
            cache, r = carry
            write_pos = jnp.where(r.done, -1, r.pos)[:, None]
            out, cache = self.model.forward(weights.params, r.token[:, None], write_pos, cache,
                                            self.rules, self.policy, Mode.APPEND, r.column, output)
            nxt = self._next_tokens(weights, out, output, r.seed, r.count, r.temperature, r.top_k,
                                    r.top_p, masks)
            emitted = jnp.where(r.done, -1, nxt)
            count = r.count + jnp.where(r.done, 0, 1)
            done = r.done | jnp.isin(nxt, stop_ids) | (count >= r.max_tokens)
            r = r._replace(token=jnp.where(r.done, r.token, nxt), pos=r.pos + 1,
                           column=jnp.minimum(r.column + 1, self.cache_len - 1), count=count,
                           done=done)
            return (cache, r), (emitted, token_logprobs(out, nxt) if logprobs else None)

        (cache, state), (out, scores) = jax.lax.scan(step, (cache, state), None, length=steps)
        scores = None if scores is None else jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1), scores)
        return out.T, cache, state, scores

    @staticmethod
    def _gather_fn(cache: KVCache, state: Rows, take: jax.Array, live: jax.Array):
        """Rows `take` of the cache and state; those not `live` (padding) are done."""
        rows = jax.tree.map(lambda x: x[take], cache._replace(pending=None))
        state = jax.tree.map(lambda x: x[take], state)
        return rows, state._replace(done=state.done | ~live)

    # --- host side ----------------------------------------------------------------------------

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(f"prompt of {length} tokens exceeds max_prompt_len={self.max_prompt_len}")

    def _stop_array(self, stop_ids: Sequence[int]) -> jax.Array:
        return stop_array(self._stops, stop_ids, self._everywhere)

    def insert(self, targets: Sequence[Sequence[int]], requests: Sequence[Request],
               stop_ids: Sequence[int] = (), samples: Sequence[Sequence[int]] | None = None,
               shared: int = 0, masks: np.ndarray | None = None) -> Inserted:
        """Prefills each of `requests` once into its free rows targets[i] (one per sample; as
        many requests as an insert size, padded to the next one otherwise). samples[i] are the
        sample indices those rows draw (default 0, 1, ...): each row's seed is
        `sample_seed(request.seed, sample)`. shared > 0: every prompt's first `shared` blocks
        are in the prefix pool (`prefix_match`), and only the rest is computed. Afterwards the
        prompts' blocks that the pool lacks are kept in it. masks [rows, W], one per target row
        in the order of `Inserted.first`: the tokens each first token may be (all bits set:
        any), as `allowed_tokens` reads them."""
        if self.rows != self.batch_size:
            raise RuntimeError("insert after shrink: reset the engine first")
        n = len(requests)
        if not 0 < n == len(targets) or n > self.insert_sizes[-1] or not all(targets):
            raise ValueError(f"insert takes 1..{self.insert_sizes[-1]} requests, rows for each")
        samples = samples or [range(len(t)) for t in targets]
        R = next(r for r in self.insert_sizes if r >= n)
        F = 1 << (max(len(t) for t in targets) - 1).bit_length()  # rows per prompt: a power of two
        C = shared * self.prefix.block if shared else 0
        blocks = None
        if shared:
            found = [self.prefix.match(r.prompt, shared) for r in requests]
            if any(len(b) != shared for b in found):
                raise ValueError(f"insert: not every prompt's first {shared} blocks are in the pool")
            blocks = np.array(found + [found[0]] * (R - n), np.int32)
        P = self.bucket_for(max(len(r.prompt) for r in requests) - C)
        if C + P > self.buckets[-1]:
            raise ValueError(f"insert: {C} shared columns and a bucket of {P} exceed the "
                             f"{self.buckets[-1]} a row keeps for its prompt")
        # the same on every process; each puts its own rows. Padding entries: one token, no row.
        tokens, positions = np.zeros((R, P), np.int32), np.full((R, P), -1, np.int32)
        positions[:, -1] = C
        for i, r in enumerate(requests):
            tokens[i, P - len(r.prompt) + C:] = r.prompt[C:]
            positions[i, P - len(r.prompt) + C:] = np.arange(C, len(r.prompt))
        rows = np.full((R, F), self.batch_size, np.int32)
        seeds = np.zeros((R, F), np.uint32)
        every = list(requests) + [Request((0,), 1)] * (R - n)
        for i, (t, k) in enumerate(zip(targets, samples)):
            rows[i, : len(t)] = t
            seeds[i, : len(t)] = [sample_seed(requests[i].seed, j) for j in k]
        each = lambda f, dtype: np.repeat(np.array([f(r) for r in every], dtype), F)
        host = Prompts(tokens, positions, rows.reshape(-1), each(lambda r: r.max_tokens, np.int32),
                       seeds.reshape(-1), each(lambda r: r.temperature, np.float32),
                       each(lambda r: r.top_k, np.int32), each(lambda r: r.top_p, np.float32))
        prompts = jax.tree.map(jax.device_put, host, self._prompt_shardings(R, F))
        if masks is not None:  # into the rows' order [R * F], padding rows unmasked
            per_row = np.full((R, F, masks.shape[1]), -1, np.int32)
            per_row[tuple(np.array([(i, j) for i, t in enumerate(targets) for j in range(len(t))]).T)] = masks
            masks = jax.device_put(per_row.reshape(R * F, -1),
                                   self.rules.sharding("batch", None, shape=(R * F, masks.shape[1])))
        if blocks is not None:
            blocks = jax.device_put(blocks, self.rules.sharding("batch", None, shape=blocks.shape))
        logprobs = any(r.logprobs for r in requests)
        prompt_logprobs = any(r.prompt_logprobs for r in requests) and P > 1
        what = (f"the prefill of {R} x {P} tokens" + (f" after {C} shared" if C else "")
                + (f" into {F} rows each" if F > 1 else "")
                + (" with log-probabilities" if logprobs or prompt_logprobs else "")
                + (" under token masks" if masks is not None else ""))
        keep = self._blocks_to_keep(requests, R, P, C) if self.prefix is not None else None
        with self._first_call(what):
            first, self.cache, self.state, (scores, prompt_scores), pool = self._insert(
                self.weights, self.cache, self.state, prompts, self._stop_array(stop_ids),
                self.pool, blocks, keep, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                masks=masks)
            self.pool = pool if self.prefix is not None else None
            first = np.asarray(first).reshape(R, F)
        take = [(i, j) for i, t in enumerate(targets) for j in range(len(t))]
        picked = lambda x: np.asarray(x).reshape(R, F, *x.shape[1:])[tuple(np.array(take).T)]
        out_scores = None if scores is None else TokenLogprobs(*map(picked, scores))
        per_prompt = None
        if prompt_scores is not None:  # prompt token j > C sits in column P - len + j - C
            prompt_scores = TokenLogprobs(*map(np.asarray, prompt_scores))
            per_prompt = [[None] * C + [prompt_scores.at((i, P - len(r.prompt) + j - 1))
                                        for j in range(C + 1, len(r.prompt))]
                          for i, r in enumerate(requests)]
        return Inserted(first[tuple(np.array(take).T)], out_scores, per_prompt)

    def prefix_match(self, r: Request) -> int:
        """How many of r's first prompt blocks the prefix pool holds and an insert may take from
        it: never the whole prompt (its last token is computed for the next one), nor a position
        whose next token's log-probability r asks for, nor so many that they and the bucket of
        the rest overflow a row's prompt columns; 0 without prefix sharing."""
        if self.prefix is None:
            return 0
        scored = r.prompt_logprobs_from if r.prompt_logprobs else len(r.prompt)
        m = len(self.prefix.match(r.prompt, (min(len(r.prompt), scored) - 1) // self.prefix.block))
        # the shared columns and the rest's bucket within the room a row keeps for its prompt
        room, block = self.buckets[-1], self.prefix.block
        while m and m * block + self.bucket_for(len(r.prompt) - m * block) > room:
            m -= 1
        return m

    def shared_tokens(self, blocks: int) -> int:
        return blocks * self.prefix.block if blocks else 0

    def shares_first_block(self, a: Request, b: Request) -> bool:
        """Whether two prompts start with the same block, which the pool does not hold yet."""
        if self.prefix is None:
            return False
        da, db = self.prefix.digests(a.prompt)[:1], self.prefix.digests(b.prompt)[:1]
        return bool(da) and da == db and not self.prefix.holds(da[0])

    def _blocks_to_keep(self, requests: Sequence[Request], R: int, P: int, C: int) -> Keep:
        """The full blocks of the prompts about to be inserted that the pool lacks, claimed in the
        index now and named for the insert to copy (prompt token j, from C on, sits in column
        C + P - len + j of its prompt's row). [R * P / block] entries, padding after them: a
        prompt has at most P / block blocks to keep, so the insert's shapes stay its own."""
        K = R * (P // self.prefix.block)
        if not K:  # a bucket shorter than a block: no prompt has a full block after the shared
            return None
        wanted, where = [], []
        for i, r in enumerate(requests):
            for b, d in enumerate(self.prefix.digests(r.prompt)):
                if b * self.prefix.block >= C and not self.prefix.holds(d) and d not in wanted:
                    wanted.append(d)
                    where.append((i, C + P - len(r.prompt) + b * self.prefix.block))
        blocks = self.prefix.claim(wanted)
        rows, starts, ids = (np.full(K, v, np.int32) for v in (0, 0, self.prefix.blocks))
        if blocks:
            rows[: len(blocks)], starts[: len(blocks)] = zip(*where[: len(blocks)])
            ids[: len(blocks)] = blocks
        put = partial(jax.device_put, device=self._everywhere)
        return Keep(put(rows), put(starts), put(ids))

    def decode(self, stop_ids: Sequence[int] = (), logprobs: bool = False,
               masks: np.ndarray | None = None) -> tuple[np.ndarray, TokenLogprobs | None]:
        """steps_per_dispatch steps of every row: the tokens [rows, steps] (-1 where a row was
        done) and, with logprobs, their TokenLogprobs [rows, steps]. With masks [rows, W] (the
        tokens each row may take, as `allowed_tokens` reads them), one step."""
        what = (f"the decode step of {self.rows} rows" + (" with log-probabilities" if logprobs else "")
                + (" under token masks" if masks is not None else ""))
        if masks is not None:
            masks = jax.device_put(masks, self.rules.sharding("batch", None, shape=masks.shape))
        with self._first_call(what):
            emitted, self.cache, self.state, scores = self._decode(
                self.weights, self.cache, self.state, self._stop_array(stop_ids), logprobs=logprobs,
                masks=masks)
            scores = None if scores is None else TokenLogprobs(*map(np.asarray, scores))
            return np.asarray(emitted), scores

    def shrink(self, rows: Sequence[int]) -> int:
        """At the end of a job, when no request waits: the cache rows `rows` (the live ones) gathered
        into the smallest of `tail_sizes` that holds them, renumbered 0, 1, ... in the order given;
        returns the rows the cache now has. A decode step of fewer rows costs less (the products'
        arithmetic, the attention's reads), so the job's last requests stop paying for the rows
        that finished."""
        fits = [b for b in self.tail_sizes if len(rows) <= b < self.rows]
        if not fits:
            return self.rows
        size = min(fits)
        take = np.zeros((size,), np.int32)
        take[: len(rows)] = rows
        live = np.arange(size) < len(rows)
        put = partial(jax.device_put, device=self._everywhere)
        with self._first_call(f"the move into {size} rows"):
            self.cache, self.state = self._gather(self.cache, self.state, put(take), put(live))
        self.rows = size
        return size

    def reset(self) -> None:
        """Back to `batch_size` empty rows, after a `shrink`."""
        if self.rows != self.batch_size:
            self.cache, self.state = None, None  # the small cache goes before the full one comes
            self.cache = self._new_cache(self.batch_size, self.cache_len)
            self.state = self._idle()
            self.rows = self.batch_size
