"""Sampling on device: the next token of each row from its logits (greedy, temperature, top_k,
top_p, a format's token mask), drawn from the row's own key so that a request's tokens never
depend on its neighbours; and the tokens' log-probabilities.

"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models.decoder import Output

# The most alternatives a token's log-probabilities list; the programs always compute this many,
# so no request's `logprobs` recompiles anything.
MAX_LOGPROBS = 20


class TokenLogprobs(NamedTuple):
    """Log-probabilities of tokens under the model's own distribution, the log_softmax of its
    logits in float32 (before temperature, top_k and top_p): of the token itself, and of the
    MAX_LOGPROBS most likely in its place with their ids, most likely first (ties: lowest id)."""

    logprob: Any  # [...]
    top_ids: Any  # [..., MAX_LOGPROBS]
    top_logprobs: Any  # [..., MAX_LOGPROBS]

    def at(self, i) -> TokenLogprobs:
        return TokenLogprobs(*(x[i] for x in self))


def sample_seed(seed: int, sample: int) -> int:
    """The seed sample `sample` of a request draws with: the request's own for sample 0 (so a
    request of one sample draws as it always has), else SplitMix64's output for the 64 bits
    (seed, sample), taken to 32: a stream of its own for every sample."""
    if sample == 0:
        return seed % 2**32
    z = ((seed % 2**32) << 32 | sample) + 0x9E3779B97F4A7C15 & 2**64 - 1
    z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9 & 2**64 - 1
    z = (z ^ z >> 27) * 0x94D049BB133111EB & 2**64 - 1
    return (z ^ z >> 31) & 2**32 - 1


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> TokenLogprobs:
    """logits [..., V], tokens [...] -> their TokenLogprobs."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logp.shape[-1]))
    taken = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[..., None].astype(jnp.int32), axis=-1)
    return TokenLogprobs(taken[..., 0], ids.astype(jnp.int32), top)


def unpacked(masks: jax.Array, V: int) -> jax.Array:
    """Bitmasks [B, ceil(V / 32)] (int32 words, bit t % 32 of word t // 32 for token t) -> which
    tokens each row may take, bool [B, V]."""
    bits = (masks[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    return bits.reshape(masks.shape[0], -1)[:, :V] != 0


def allowed_tokens(masks: jax.Array, logits: jax.Array) -> jax.Array:
    """logits [B, V] with the tokens the bitmasks masks [B, W] (`unpacked`) leave out set to
    -inf: a format's constraint, applied before temperature, top_k and top_p. In the logits'
    dtype: the sampler reads them as they are (bfloat16 on TPU)."""
    return jnp.where(unpacked(masks, logits.shape[-1]), logits, jnp.array(-jnp.inf, logits.dtype))


def masked_greedy(greedy: jax.Array, masks: jax.Array, V: int) -> jax.Array:
    """The greedy tokens [B] under the bitmasks masks [B, W] where they follow from the unmasked
    greedy tokens: the same token where the mask allows it (the largest logit, ties to the lowest
    id, of all is that of the allowed too), the one token a mask allows, else -1."""
    keep = unpacked(masks, V)
    ok = jnp.take_along_axis(keep, greedy[:, None], axis=1)[:, 0]
    only = jnp.argmax(keep, axis=1).astype(jnp.int32)  # the first allowed id
    return jnp.where(ok, greedy, jnp.where(jnp.sum(keep, axis=1) == 1, only, -1))


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (ties to the lowest index) as two plain reductions: XLA:CPU
    runs argmax's paired (value, index) reduction element by element, far slower."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)  # exact in the logits' dtype, as in float32
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(logits == top, ids, V), axis=-1), V - 1)  # a NaN row: V-1


def _codes(x: jax.Array) -> jax.Array:
    """Floats (bfloat16, float16 or float32) -> int32 codes in the same order, in the dtype's own
    code space: 2**16 codes for a 16-bit float (negative floats have their magnitude bits
    flipped)."""
    bits = jnp.finfo(x.dtype).bits
    i = jax.lax.bitcast_convert_type(x, jnp.int16 if bits == 16 else jnp.int32).astype(jnp.int32)
    return jnp.where(i < 0, i ^ (2 ** (bits - 1) - 1), i)


def _floats(c: jax.Array, dtype) -> jax.Array:
    """The inverse of _codes: int32 codes -> floats of dtype."""
    bits = jnp.finfo(dtype).bits
    i = jnp.where(c < 0, c ^ (2 ** (bits - 1) - 1), c)
    return jax.lax.bitcast_convert_type(i.astype(jnp.int16 if bits == 16 else jnp.int32), dtype)


# Codes a pass over the vocabulary tests at once when looking for top_k's and top_p's thresholds
# (one less than a power of 2): each pass cuts a row's interval of codes into 16, so 4 passes find
# a threshold among bfloat16 logits' 2**16 codes and 8 among float32's. XLA:TPU fuses 15 sums of
# probability into one read of the logits, and reads them twice for 16.
PROBES = 15
# The passes run in a loop, so that every program that samples compiles one pass, not 8 per
# threshold (float32 logits). XLA's cost analysis counts a loop's body once, so
# benchmarks/tpu_decode_bytes.py and tpu_sampler_bytes.py unroll them to count each pass.
UNROLL_PASSES = False


def _smallest_true(pred: Callable[[jax.Array], jax.Array], lo: jax.Array, hi: jax.Array,
                   bits: int) -> jax.Array:
    """The smallest int32 code v in (lo, hi] [B, 1] with pred(v) true, per row, for pred monotone
    (false, then true) and hi - lo <= 2**bits; hi itself when none is. pred takes codes [B, PROBES]
    and tests them all in one pass over the vocabulary."""
    parts = PROBES + 1
    j = jnp.arange(1, parts, dtype=jnp.uint32)

    def narrow(_, bounds):
        lo, hi = bounds
        span = jax.lax.bitcast_convert_type(hi - lo, jnp.uint32)  # < 2**32, though int32 wraps
        step = span // parts * j + span % parts * j // parts  # span * j // parts, in uint32
        probe = lo + jax.lax.bitcast_convert_type(step, jnp.int32)
        probe = jnp.maximum(probe, lo + 1)  # in (lo, hi)
        ok = pred(probe)
        return (jnp.max(jnp.where(ok, lo, probe), axis=1, keepdims=True),
                jnp.min(jnp.where(ok, probe, hi), axis=1, keepdims=True))

    passes = -(-bits // (parts.bit_length() - 1))
    return jax.lax.fori_loop(0, passes, narrow, (lo, hi), unroll=UNROLL_PASSES)[1]


class _Logits(NamedTuple):
    """A step's logits [B, V] as the model made them (bfloat16 on TPU) and the rows' temperatures
    [B, 1]. Every pass over the vocabulary reads `raw` and scales it itself, so the float32 scaled
    logits are never written out; scaling is monotone, so the raw logits' codes order them too."""

    raw: jax.Array
    temperature: jax.Array

    def scaled(self, raw: jax.Array | None = None) -> jax.Array:
        """float32 [B, ...]: raw logits (of this row) / the row's temperature."""
        return (self.raw if raw is None else raw).astype(jnp.float32) / self.temperature

    def at(self, codes: jax.Array) -> jax.Array:
        """The scaled logit [B, n] of each raw logit's code [B, n]."""
        return self.scaled(_floats(codes, self.raw.dtype))


class _Candidates(NamedTuple):
    """The CANDIDATES largest logits of each row and what `nucleus` keeps of them."""

    vals: jax.Array  # [B, C] f32 scaled, descending
    raw: jax.Array  # [B, C] the raw logits
    ids: jax.Array  # [B, C] int32
    keep: jax.Array  # [B, C] bool: kept by top_k and top_p
    fits: jax.Array  # [B] bool: the nucleus is what `keep` holds, every logit it keeps among them
    top: jax.Array  # [B, 1] f32: the largest scaled logit
    sumexp: jax.Array  # [B, 1] f32: the sum of exp(scaled - top) over the whole vocabulary


def _top_k_filters(top_k: jax.Array, V: int) -> jax.Array:
    """Which rows' top_k [B] filters anything: 0 (and a negative top_k) or V and more keep all."""
    return (top_k > 0) & (top_k < V)


def _candidates(x: _Logits, top_k: jax.Array, top_p: jax.Array) -> _Candidates:
    """What `nucleus` keeps among the CANDIDATES largest logits, from one top_k over the raw
    logits and one pass for the softmax's sum. A row fits when every logit its nucleus keeps
    lies above the smallest candidate; a row whose top_k reaches past the candidates never does
    (its probabilities are over more than they hold), nor does a row with no filter."""
    V = x.raw.shape[-1]
    C = min(CANDIDATES, V)
    raw, ids = jax.lax.top_k(x.raw, C)  # descending
    vals = x.scaled(raw)
    top = jnp.max(vals, axis=1, keepdims=True)  # the largest scaled logit: scaling is monotone
    last = jnp.min(vals, axis=1, keepdims=True)  # the smallest candidate
    by_k = _top_k_filters(top_k, V)[:, None]
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, C - 1)[:, None], axis=1)
    kth = jnp.where(by_k, kth, -jnp.inf)  # top_k keeps every logit >= kth
    in_k = vals >= kth
    # the whole vocabulary's logsumexp as jax.nn.logsumexp takes it
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0))
    sumexp = jnp.sum(jnp.exp(x.scaled() - shift), axis=-1, keepdims=True)
    within = jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1, keepdims=True)
    norm = jnp.where(by_k, within, jnp.log(sumexp) + shift)
    p = jnp.where(in_k, jnp.exp(vals - norm), 0)
    # the mass strictly above each value, ties apart, by [C, C] comparisons: any slice of the
    # top_k's values (vals[:, -1:] included) makes XLA:CPU sort the whole vocabulary instead
    above = jnp.sum(jnp.where(vals[:, :, None] > vals[:, None, :], p[:, :, None], 0), axis=1)
    keep = in_k & ((above < top_p[:, None]) | (top_p[:, None] >= 1))
    smallest = jnp.min(jnp.where(keep, vals, jnp.inf), axis=1, keepdims=True)
    filters, by_k = by_k[:, 0] | (top_p < 1), by_k[:, 0]
    fits = ((smallest > last)[:, 0] | (C == V)) & filters & ~(by_k & (top_k > C))
    return _Candidates(vals, raw, ids, keep, fits, top, sumexp)


def _nucleus_floor(x: _Logits, c: _Candidates, top_k: jax.Array, top_p: jax.Array,
                   rows: jax.Array) -> jax.Array:
    """The smallest scaled logit `nucleus` keeps [B, 1], for the rows [B] that ask (-inf for the
    others): top_k's threshold (the k-th largest logit: a candidate, else found among the codes of
    the raw logits), then top_p's among those it keeps above it. A threshold is always some raw
    logit's scaled value, so searching the raw logits' codes (2**16 for bfloat16) finds it."""
    V = x.raw.shape[-1]
    bits = jnp.finfo(x.raw.dtype).bits
    C = c.vals.shape[-1]
    never = _codes(jnp.full((x.raw.shape[0], 1), -jnp.inf, x.raw.dtype))
    ever = _codes(jnp.full((x.raw.shape[0], 1), jnp.inf, x.raw.dtype))
    by_k = (rows & _top_k_filters(top_k, V))[:, None]
    beyond = by_k & (top_k > C)[:, None]  # the k-th largest lies past the candidates
    k = top_k[:, None]

    def counted():  # the k-th largest, by its code: one below the smallest that fewer than k reach
        fewer = lambda v: jnp.stack([jnp.sum(x.scaled() >= t[:, None], axis=-1)
                                     for t in x.at(v).T], axis=1) < k
        return _smallest_true(fewer, never, ever, bits) - 1

    def within_k():  # the k-th largest's code, and the softmax's sum over the logits kept
        kth = jax.lax.cond(jnp.any(beyond), counted, lambda: never)
        kth = jnp.where(beyond, kth, jnp.where(
            by_k, _codes(jnp.take_along_axis(c.raw, jnp.clip(k - 1, 0, C - 1), axis=1)), never))
        scaled = x.scaled()
        sumexp = jnp.sum(jnp.where(scaled >= x.at(kth), jnp.exp(scaled - c.top), 0), axis=-1,
                         keepdims=True)
        return kth, jnp.where(by_k, sumexp, c.sumexp)

    kth, sumexp = jax.lax.cond(jnp.any(by_k), within_k, lambda: (never, c.sumexp))
    floor = x.at(kth)  # top_k keeps every logit >= floor (-inf: all)

    def under(v: jax.Array) -> jax.Array:  # [B, n]: the probability strictly above at(v) < top_p
        scaled = x.scaled()  # every logit above at(v) >= floor is one top_k keeps
        probs = jnp.exp(scaled - c.top) / sumexp
        mass = [jnp.sum(jnp.where(scaled > t[:, None], probs, 0), axis=-1) for t in x.at(v).T]
        return jnp.stack(mass, axis=1) < top_p[:, None]

    # the nucleus' smallest logit: the smallest v whose mass strictly above is under top_p, kth
    # itself where that is everything top_k keeps
    smallest = _smallest_true(under, kth - 1, _codes(jnp.max(c.raw, axis=1, keepdims=True)), bits)
    everything = top_p[:, None] >= 1  # top_p 1 keeps all, whatever the rounding
    return jnp.where(rows[:, None], jnp.where(everything, floor, x.at(smallest)), -jnp.inf)


def nucleus(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """scaled [B, V] with what top_k and top_p leave out set to -inf.

    top_k (0: all) keeps the logits at least as large as the k-th largest, ties to it included, as
    transformers' TopKLogitsWarper does; top_p then keeps the smallest set of the largest whose
    probability (over what top_k kept) reaches top_p, and every logit equal to the smallest kept.
    Both thresholds are found among the logits' codes, PROBES codes tested per pass over the
    vocabulary, rather than by sorting it: a sort of [64, 201088] logits on every decode step was
    the largest item in GPT-OSS-20B's decode on v5e after the weights.
    """
    x = _Logits(scaled, jnp.ones((scaled.shape[0], 1), jnp.float32))
    rows = jnp.ones(scaled.shape[:1], bool)
    floor = _nucleus_floor(x, _candidates(x, top_k, top_p), top_k, top_p, rows)
    return jnp.where(scaled >= floor, scaled, -jnp.inf)


# Candidates a sampled row's nucleus is looked for among: the largest logits, found by one top_k.
CANDIDATES = 128


def _gumbel(keys: jax.Array, ids: jax.Array) -> jax.Array:
    """Gumbel noise [B, n] for token ids [B, n] of rows with keys [B]: each token's from its own
    key (the row's folded with the id), so a token draws the same noise whichever set of tokens
    it is drawn among."""
    tiny = jnp.finfo(jnp.float32).tiny

    def one(key, i):
        return jax.random.uniform(jax.random.fold_in(key, i), (), jnp.float32, tiny, 1.0)

    u = jax.vmap(lambda key, row: jax.vmap(partial(one, key))(row))(keys, ids)
    return -jnp.log(-jnp.log(u))


def _whole(x: _Logits, floor: jax.Array, keys: jax.Array) -> jax.Array:
    """Gumbel-max over every logit at least floor [B, 1] (-inf: the whole vocabulary), in one
    pass: each row's token [B] int32, ties to the lowest id."""
    scaled = x.scaled()
    every = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
    noisy = jnp.where(scaled >= floor, scaled + _gumbel(keys, every), -jnp.inf)
    return jnp.argmax(noisy, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array | Callable[[], jax.Array], seeds: jax.Array, counts: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           greedy: jax.Array | None = None) -> jax.Array:
    """Per-row sampling. logits [B, V]; seeds [B] uint32 and counts [B] int32 (the row's key is its
    seed's, folded with the number of tokens it has generated); temperature, top_p [B] f32;
    top_k [B] int32. Where the caller has the greedy tokens [B] already (greedy_screened),
    `logits` may be a function, called only when some row samples.

    temperature 0 is greedy; top_k 0 (or V) and top_p 1 disable those filters (see `nucleus`). A
    sampled row draws by Gumbel-max over what `nucleus` keeps, each token's noise from its own key
    (`_gumbel`), in one of three ways that its own settings and logits choose, so a row's tokens
    never depend on its neighbours: a row without filters (plain sampling) over the whole
    vocabulary in one pass; a row with filters among the CANDIDATES largest logits when its
    nucleus lies among them (one top_k); else over the whole vocabulary, above the threshold
    `nucleus` finds. Keys are derived only when some row samples, so a greedy decode step spends
    nothing on random numbers. Every pass reads the logits as they are (bfloat16 on TPU).
    """
    if greedy is None:
        greedy = greedy_tokens(logits)

    def stochastic() -> jax.Array:
        x = _Logits(logits() if callable(logits) else logits,
                    jnp.maximum(temperature, 1e-6)[:, None])
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seeds), counts)
        sampled = temperature > 0
        plain = (top_p >= 1) & ~_top_k_filters(top_k, x.raw.shape[-1])

        def filtered() -> jax.Array:  # some sampled row has a filter
            c = _candidates(x, top_k, top_p)
            pick = jnp.argmax(jnp.where(c.keep, c.vals + _gumbel(keys, c.ids), -jnp.inf), axis=-1)
            drawn = jnp.take_along_axis(c.ids, pick[:, None], axis=1)[:, 0]
            wide = sampled & ~c.fits  # plain rows, and those whose nucleus reaches past them
            need = wide & ~plain
            floor = jax.lax.cond(jnp.any(need),
                                 lambda: _nucleus_floor(x, c, top_k, top_p, need),
                                 lambda: jnp.full((x.raw.shape[0], 1), -jnp.inf))
            return jax.lax.cond(jnp.any(wide),
                                lambda: jnp.where(c.fits, drawn, _whole(x, floor, keys)),
                                lambda: drawn)

        drawn = jax.lax.cond(jnp.any(sampled & ~plain), filtered,
                             lambda: _whole(x, jnp.full((x.raw.shape[0], 1), -jnp.inf), keys))
        return jnp.where(sampled, drawn, greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)


def next_tokens(model, rules, policy, weights, out, output, seeds, counts, temperature, top_k,
                top_p, masks=None) -> jax.Array:
    """The next token of each row from the position it samples at: `out` is its logits [B, V]
    (output LOGITS), or its hidden state [B, D] (HIDDEN, with the greedy screen of
    weights = (params, screen)), whose greedy tokens come through the screen and whose logits are
    made only for rows that sample. masks [B, W]: the tokens each row may take
    (`allowed_tokens`); through the screen, the logits are made only when some row's greedy token
    under its mask is neither the screen's nor forced (`masked_greedy`)."""
    params, screen = weights
    if output is Output.LOGITS:
        logits = out if masks is None else allowed_tokens(masks, out)
        return sample(logits, seeds, counts, temperature, top_k, top_p)
    u = model.unembedding(params)
    greedy = policy.backend.screened_greedy()(out, u.w, screen, w_nk=u.vocab_first)
    logits = lambda: u.logits(out[:, None], rules, policy)[:, 0]
    if masks is not None:
        unmasked = logits
        logits = lambda: allowed_tokens(masks, unmasked())
        cheap = masked_greedy(greedy, masks, model.vocab_size)
        greedy = jax.lax.cond(jnp.any((cheap < 0) & (temperature <= 0)),
                              lambda: jnp.where(cheap < 0, greedy_tokens(logits()), cheap),
                              lambda: cheap)
    return sample(logits, seeds, counts, temperature, top_k, top_p, greedy=greedy)


def greedy_screen(model, params, policy, rows: int):
    """The unembedding's int8 screen where the backend builds one for `rows` rows
    (Backend.greedy_screen), else None; of abstract params (ShapeDtypeStructs), its shapes,
    placed as the unembedding is."""
    u = model.unembedding(params)
    build = policy.backend.greedy_screen(u.w, rows)
    if build is None:
        return None
    build = partial(build, w_nk=u.vocab_first)
    if isinstance(u.w, jax.Array):
        return build(u.w)
    # computed from the unembedding, the screen lands where it is (its mesh, replicated: the
    # screen is a one-device kernel's)
    where = NamedSharding(u.w.sharding.mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where),
                        jax.eval_shape(build, u.w))


# Positions unembedded at once for a prompt's log-probabilities: bounds the logits held to rows x
# this x vocabulary.
PROMPT_LOGPROB_POSITIONS = 64


def position_logprobs(unembedding, hidden: jax.Array, targets: jax.Array, rules, policy
                      ) -> TokenLogprobs:
    """The TokenLogprobs [R, P] of targets [R, P] (each position's next token) from the final
    norm's output hidden [R, P, D], PROMPT_LOGPROB_POSITIONS positions at a time."""
    R, P, D = hidden.shape
    C = min(PROMPT_LOGPROB_POSITIONS, P)
    n = -(-P // C)
    h = jnp.pad(hidden, ((0, 0), (0, n * C - P), (0, 0)))
    nxt = jnp.pad(targets, ((0, 0), (0, n * C - P)))

    def chunk(i):
        hs = jax.lax.dynamic_slice_in_dim(h, i * C, C, axis=1)
        return token_logprobs(unembedding.logits(hs, rules, policy),
                              jax.lax.dynamic_slice_in_dim(nxt, i * C, C, axis=1))

    parts = jax.lax.map(chunk, jnp.arange(n))  # [n, R, C, ...]
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(R, n * C, *x.shape[3:])[:, :P], parts)
