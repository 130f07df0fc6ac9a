"""The generation engine: a pre-allocated sharded KV cache, a jitted prefill per prompt-length
bucket, and a jitted decode step that runs several tokens per dispatch, the cache donated to both.

Prompts are left-padded to their bucket, so every row's last prompt token sits in the same column
and one decode step writes one cache slot for the whole batch; positions (-1 for padding) drive
RoPE and the masks. Sampling happens on device with a key per request, so a request's output
depends on its seed, not on the batch it landed in.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import PRODUCT_KERNEL_ROWS, KVCache, Policy
from models.registry import Model
from runner import hugepages
from sharding.rules import Rules

MAX_STOP_IDS = 16  # stop ids are passed as a fixed-size array, so their number never recompiles


@dataclasses.dataclass(frozen=True)
class Request:
    """One row to generate: prompt ids and per-request sampling settings."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclasses.dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str  # stop | length
    ttft_s: float = 0.0  # from the call to the first tokens on the host
    decode_s: float = 0.0  # from then to the last tokens on the host (the same for every row)


def buckets(max_prompt_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest`, capped by (and ending at) the maximum prompt length."""
    out, b = [], smallest
    while b < max_prompt_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_prompt_len,)


def first_max(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (ties to the lowest index) as two plain reductions: XLA:CPU
    runs argmax's paired (value, index) reduction element by element, 600 us for [8, 32000]."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(logits == top, ids, V), axis=-1), V - 1)  # a NaN row: V-1


def _ordered(x: jax.Array) -> jax.Array:
    """float32 -> int32 in the same order (negative floats have their magnitude bits flipped)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ 0x7FFFFFFF, i)


def _unordered(i: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.where(i < 0, i ^ 0x7FFFFFFF, i), jnp.float32)


def _smallest_true(pred: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array) -> jax.Array:
    """The smallest int32 v in (lo, hi] with pred(v) true, per row, for pred false at lo and
    monotone (false, then true): 32 halvings cover any int32 range. hi itself when none is."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # (lo + hi) // 2 without overflow
        ok = pred(mid) & (mid > lo)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def nucleus(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [B, V] with what top_k and top_p leave out set to -inf.

    top_k (0: all) keeps the logits at least as large as the k-th largest, ties to it included, as
    transformers' TopKLogitsWarper does; top_p then keeps the smallest set of the largest whose
    probability (over what top_k kept) reaches top_p, and every logit equal to the smallest kept.
    Both thresholds are found by halving over the floats' order, 32 masked sums over the
    vocabulary each, rather than by sorting it: a sort of [64, 201088] logits on every decode step
    was the largest item in GPT-OSS-20B's decode on v5e after the weights.
    """
    V = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[:, None]
    lo = _ordered(jnp.min(scaled, axis=-1, keepdims=True))
    hi = _ordered(jnp.max(scaled, axis=-1, keepdims=True))
    # the k-th largest: one below the smallest v that fewer than k logits reach
    fewer = lambda v: jnp.sum(scaled >= _unordered(v), axis=-1, keepdims=True) < k
    kth = jnp.where(fewer(hi), _smallest_true(fewer, lo, hi) - 1, hi)  # hi: k = 1 or all tie
    kept = jnp.where(scaled >= _unordered(kth), scaled, -jnp.inf)
    probs = jax.nn.softmax(kept, axis=-1)
    # the nucleus' smallest logit: the smallest v whose mass strictly above is under top_p
    under = lambda v: (jnp.sum(jnp.where(kept > _unordered(v), probs, 0), axis=-1, keepdims=True)
                       < top_p[:, None])
    below = kth - 1  # everything top_k kept lies above
    everything = under(below) | (top_p[:, None] >= 1)  # top_p 1 keeps all, whatever the rounding
    smallest = jnp.where(everything, kth, _smallest_true(under, below, hi))
    return jnp.where(kept >= _unordered(smallest), kept, -jnp.inf)


def sample(logits: jax.Array | Callable[[], jax.Array], seeds: jax.Array, counts: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           greedy: jax.Array | None = None) -> jax.Array:
    """Per-row sampling. logits [B, V]; seeds [B] uint32 and counts [B] int32 (the row's key is its
    seed's, folded with the number of tokens it has generated); temperature, top_p [B] f32;
    top_k [B] int32. Where the caller has the greedy tokens [B] already (greedy_screened),
    `logits` may be a function, called only when some row samples.

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters (see `nucleus`). Keys are
    derived only when some row samples, so a greedy decode step spends nothing on random numbers.
    """
    if greedy is None:
        logits = logits.astype(jnp.float32)
        greedy = first_max(logits)

    def stochastic() -> jax.Array:
        scaled = (logits() if callable(logits) else logits).astype(jnp.float32)
        scaled = scaled / jnp.maximum(temperature, 1e-6)[:, None]
        masked = nucleus(scaled, top_k, top_p)
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seeds), counts)
        drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)


class Engine:
    """Batched generation for one model on one mesh; compiled functions are reused across batches."""

    def __init__(self, model: Model, params, rules: Rules, policy: Policy, batch_size: int,
                 max_prompt_len: int, max_new_tokens: int, steps_per_dispatch: int = 8,
                 prefill_buckets: Sequence[int] = (), allocate: bool = True, prefill_rows: int = 0):
        """`params` may be abstract (ShapeDtypeStructs) with allocate=False: enough to `lower`.

        prefill_rows > 0 prefills the batch that many rows at a time (rounded up to a multiple of
        the `data` shards), in a loop on device: a prompt's activations and attention scores then
        take memory for those rows alone, while decode still runs the whole batch.
        """
        data = rules.shards("batch")
        self.batch_size = -(-batch_size // data) * data  # a whole number of rows per data shard
        rows = -(-prefill_rows // data) * data if prefill_rows > 0 else self.batch_size
        while self.batch_size % rows:  # a whole number of groups; rows stays a multiple of data
            rows += data
        self.prefill_rows = rows
        self.model, self.params, self.rules, self.policy = model, params, rules, policy.on(rules)
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.steps = max(1, min(steps_per_dispatch, max_new_tokens))
        self.buckets = tuple(sorted(prefill_buckets)) or buckets(max_prompt_len)
        if self.buckets[-1] < max_prompt_len:
            raise ValueError(f"prefill buckets {self.buckets} do not reach max_prompt_len={max_prompt_len}")
        self.cache_len = self.buckets[-1] + max_new_tokens
        new_cache = partial(model.new_cache, self.batch_size, self.cache_len, jnp.dtype(policy.kv_cache),
                            rules, policy.scan_layers)
        cache_sh = model.cache_shardings(rules, jnp.dtype(policy.kv_cache) == jnp.int8, policy.scan_layers)
        if allocate:
            self.cache = new_cache()
        else:  # shapes with their shardings, so donation pairs the cache with the cache alone
            self.cache = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                      jax.eval_shape(new_cache), cache_sh)
        self.screen = self._greedy_screen() if allocate else None
        # (bytes on 2 MiB pages, bytes asked) of the weights and cache: CPU only, and only where
        # the system gives huge pages (Linux 6.1 on); (0, 0) when not asked
        self.huge_pages = (hugepages.collapse((self.params, self.cache, self.screen))
                           if allocate and policy.huge_pages and rules.platform == "cpu" else (0, 0))
        # Every array crossing the jit boundary has a fixed sharding, so no call recompiles. What the
        # host reads back (new tokens, done flags) is replicated, so every process of a multi-host
        # run can read all of it and take the same decisions.
        row = self._row = rules.sharding("batch", shape=(self.batch_size,))
        self._rows2d = rules.sharding("batch", None, shape=(self.batch_size, 1))
        everywhere = self._everywhere = rules.sharding()
        # XLA:CPU's default copy insertion copies every layer's whole cache on every step when a
        # layer's cache is both read (attention) and written in place; region analysis sees that
        # the read comes first (SmolLM2 decode, B=1: 120 copies of [1, 3, 256, 64] per step gone).
        opts = {"xla_cpu_copy_insertion_use_region_analysis": True} if rules.platform == "cpu" else None
        donate = (1,) if policy.donate_cache else ()  # the cache is updated in place, not copied
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=donate, compiler_options=opts,
                                out_shardings=(everywhere, row, cache_sh))
        # The done flags come back twice: replicated for the host to read, and by rows to feed
        # the next call as they are, with nothing put back from the host unless it ended a row.
        self._decode = jax.jit(self._decode_fn, donate_argnums=donate, compiler_options=opts,
                               out_shardings=(everywhere, cache_sh, row, row, everywhere, row, row))
        self._slots: dict[int, jax.Array] = {}  # cache slot -> that scalar on the devices

    def _greedy_screen(self):
        """The unembedding's int8 screen (models/kernels/cpu.greedy_screen) where greedy tokens can
        come through it: precision.greedy_screen, one CPU device with podrun's kernels, float32
        activations and unembedding, and a batch of up to PRODUCT_KERNEL_ROWS rows; else None."""
        p, u = self.policy, self.model.unembedding(self.params)
        if not (p.greedy_screen and p.kernels and p.one_cpu_device and p.dtype == jnp.float32
                and isinstance(u.w, jax.Array) and u.w.dtype == jnp.float32
                and self.batch_size <= PRODUCT_KERNEL_ROWS):
            return None
        from models.kernels import cpu

        return cpu.greedy_screen(u.w, w_nk=u.vocab_first) if cpu.available() else None

    @property
    def screen_bytes(self) -> int:
        """Bytes of the screen, which a greedy step reads in place of the unembedding (0: none)."""
        return sum(a.nbytes for a in jax.tree.leaves(self.screen))

    def lower(self) -> dict[str, jax.stages.Lowered]:
        """Every function generation runs, lowered for the mesh's devices (which may be an AOT
        topology with no devices attached): one prefill per bucket and the decode step."""
        B, weights = self.batch_size, (self.params, self.screen)

        def arg(shape, dtype, sharding):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        rows = [arg((B,), jnp.uint32, self._row), arg((B,), jnp.float32, self._row),
                arg((B,), jnp.int32, self._row), arg((B,), jnp.float32, self._row)]
        out = {}
        for P in self.buckets:
            ids = arg((B, P), jnp.int32, self._rows2d)
            out[f"prefill_{P}"] = self._prefill.lower(weights, self.cache, ids, ids, *rows)
        row_i = arg((B,), jnp.int32, self._row)
        flag = arg((B,), jnp.bool_, self._row)
        out["decode"] = self._decode.lower(
            weights, self.cache, row_i, row_i, arg((), jnp.int32, self._everywhere), flag, row_i, row_i,
            *rows, arg((MAX_STOP_IDS,), jnp.int32, self._everywhere))
        return out

    # --- device functions ---------------------------------------------------------------------

    def _next_tokens(self, weights, out, seeds, counts, temperature, top_k, top_p) -> jax.Array:
        """The next token of each row from the forward pass' last position: `out` is its logits
        [B, V], or with a screen its hidden state [B, D] (forward without head), whose greedy
        tokens come through the screen and whose logits are made only for rows that sample."""
        params, screen = weights
        if screen is None:
            return sample(out, seeds, counts, temperature, top_k, top_p)
        from models.kernels import cpu

        u = self.model.unembedding(params)
        greedy = cpu.greedy_screened(out, u.w, screen, w_nk=u.vocab_first)
        logits = lambda: u.logits(out[:, None], self.rules, self.policy)[:, 0]
        return sample(logits, seeds, counts, temperature, top_k, top_p, greedy=greedy)

    def _prefill_fn(self, weights, cache: KVCache, tokens, positions, seeds, temperature, top_k,
                    top_p):
        params, screen = weights
        head = screen is None  # else the hidden state, for _next_tokens
        cache = cache.reset()  # forget the previous batch
        R = self.prefill_rows
        G = self.batch_size // R
        if G == 1:
            logits, cache = self.model.forward(params, tokens, positions, cache, 0, self.rules,
                                               self.policy, last_only=True, head=head)
        else:  # G groups of R rows; row b = r * G + g, so every group has rows on every data shard
            def grouped(x):  # [B, ...] -> [R, G, ...]
                return x.reshape(R, G, *x.shape[1:])

            def group(g, carry):
                cache, logits = carry
                pick = partial(jax.lax.dynamic_index_in_dim, index=g, axis=1, keepdims=False)
                sub = jax.tree.map(lambda x: pick(grouped(x)), cache)  # [R, ...]
                # untrimmed: trimming the final layer (scan.run_layers) gave this loop 2.9 MB of
                # temporaries on TPU where it had none (tests/test_compile.py), and the loop is
                # there to bound memory
                out, sub = self.model.forward(params, pick(grouped(tokens)), pick(grouped(positions)),
                                              sub, 0, self.rules, self.policy, last_only=True,
                                              trim=False, head=head)
                put = partial(jax.lax.dynamic_update_index_in_dim, index=g, axis=1)
                cache = jax.tree.map(lambda x, s: put(grouped(x), s).reshape(x.shape), cache, sub)
                return cache, put(logits, out.astype(logits.dtype))

            u = self.model.unembedding(params)
            V = self.model.vocab_size if head else u.w.shape[1 if u.vocab_first else 0]
            logits = jnp.zeros((R, G, V), jnp.float32)
            cache, logits = jax.lax.fori_loop(0, G, group, (cache, logits))
            logits = logits.reshape(self.batch_size, V)
        first = self._next_tokens(weights, logits, seeds, jnp.zeros_like(top_k), temperature, top_k,
                                  top_p)
        return first, first, cache

    def _decode_fn(self, weights, cache: KVCache, token, pos, slot, done, count, max_tokens, seeds,
                   temperature, top_k, top_p, stop_ids):
        """`self.steps` decode steps; token [B] is the newest token, at position pos [B], written
        to cache slot `slot`. Finished rows write nothing visible and emit -1."""

        def step(carry, i):
            cache, token, pos, done, count = carry
            write_pos = jnp.where(done, -1, pos)[:, None]
            out, cache = self.model.forward(weights[0], token[:, None], write_pos, cache, slot + i,
                                            self.rules, self.policy, last_only=True,
                                            head=weights[1] is None)
            nxt = self._next_tokens(weights, out, seeds, count, temperature, top_k, top_p)
            emitted = jnp.where(done, -1, nxt)
            count = count + jnp.where(done, 0, 1)
            done = done | jnp.isin(nxt, stop_ids) | (count >= max_tokens)
            return (cache, jnp.where(done, token, nxt), pos + 1, done, count), emitted

        (cache, token, pos, done, count), out = jax.lax.scan(
            step, (cache, token, pos, done, count), jnp.arange(self.steps))
        return out.T, cache, token, pos, done, count, done

    # --- host loop ----------------------------------------------------------------------------

    def bucket_for(self, length: int) -> int:
        for b in self.buckets:
            if b >= length:
                return b
        raise ValueError(f"prompt of {length} tokens exceeds max_prompt_len={self.max_prompt_len}")

    def _slot(self, slot: int) -> jax.Array:
        if slot not in self._slots:
            self._slots[slot] = jax.device_put(np.int32(slot), self._everywhere)
        return self._slots[slot]

    def generate(self, requests: Sequence[Request], stop_ids: Sequence[int] = (),
                 stop_check: Callable[[int, list[int]], bool] | None = None) -> list[Completion]:
        """Generates for up to batch_size requests. `stop_check(row, tokens)` lets the caller end a
        row on the host (stop strings); stop_ids end a row on device."""
        B, n = self.batch_size, len(requests)
        if not 0 < n <= B:
            raise ValueError(f"generate takes 1..{B} requests, got {n}")
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop_ids)} stop ids; at most {MAX_STOP_IDS} are supported")
        t0 = time.perf_counter()
        P = self.bucket_for(max(len(r.prompt) for r in requests))
        tokens = np.zeros((B, P), np.int32)  # the same on every process; each puts its own rows
        positions = np.full((B, P), -1, np.int32)
        for b, r in enumerate(requests):
            tokens[b, P - len(r.prompt):] = r.prompt
            positions[b, P - len(r.prompt):] = np.arange(len(r.prompt))
        pad = [Request((0,), 0)] * (B - n)  # padding rows: done from the start
        rows = list(requests) + pad
        put = partial(jax.device_put, device=self._row)
        seeds = put(np.array([r.seed for r in rows], np.uint32))
        temperature = put(np.array([r.temperature for r in rows], np.float32))
        top_k = put(np.array([r.top_k for r in rows], np.int32))
        top_p = put(np.array([r.top_p for r in rows], np.float32))
        max_tokens = np.array([r.max_tokens for r in rows], np.int32)
        stops = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops[: len(stop_ids)] = stop_ids
        stops_dev = jax.device_put(stops, self._everywhere)

        put2d = partial(jax.device_put, device=self._rows2d)
        first, token, self.cache = self._prefill((self.params, self.screen), self.cache, put2d(tokens),
                                                 put2d(positions), seeds, temperature, top_k, top_p)
        first = np.asarray(first)
        ttft = time.perf_counter() - t0
        out = [[int(first[b])] for b in range(n)]
        count = np.ones((B,), np.int32)
        done = np.isin(first, stops) | (count >= max_tokens)
        done[n:] = True
        stopped_on_host = set()
        for b in range(n):
            if not done[b] and stop_check and stop_check(b, out[b]):
                done[b] = True
                stopped_on_host.add(b)
        # Rows that can end only by length (no stop ids, no stop check: ignore-EOS workloads) need
        # a number of calls the host knows from the start, so each call is queued before the
        # previous one's tokens are read and the devices never wait for the host between calls.
        by_length = not stop_ids and stop_check is None
        calls_left = -(-int((max_tokens - count)[~done].max(initial=0)) // self.steps)
        state = (token, put(np.array([len(r.prompt) for r in rows], np.int32)), put(done), put(count))
        max_tokens = put(max_tokens)
        slot = P

        def call(state):
            nonlocal slot, calls_left
            token, pos, done_rows, count = state
            emitted, self.cache, token, pos, dev_done, count, done_rows = self._decode(
                (self.params, self.screen), self.cache, token, pos, self._slot(slot), done_rows, count,
                max_tokens, seeds, temperature, top_k, top_p, stops_dev)
            slot += self.steps
            calls_left -= 1
            return emitted, dev_done, (token, pos, done_rows, count)

        running = call(state) if not done.all() else None
        while running is not None:
            emitted, dev_done, state = running
            running = call(state) if by_length and calls_left > 0 else None
            emitted, dev_done = np.asarray(emitted), np.array(dev_done)
            ended_on_host = False
            for b in range(n):
                if done[b]:
                    continue
                out[b].extend(int(t) for t in emitted[b] if t >= 0)
                if not dev_done[b] and stop_check and stop_check(b, out[b]):
                    dev_done[b] = ended_on_host = True
                    stopped_on_host.add(b)
            done = dev_done
            if running is None and not done.all():
                if ended_on_host:
                    state = (*state[:2], put(done), state[3])
                running = call(state)
        decode = time.perf_counter() - t0 - ttft
        return [
            Completion(o, "stop" if o[-1] in stop_ids or b in stopped_on_host else "length", ttft,
                       decode)
            for b, o in enumerate(out)
        ]
