"""Sampling on device: the next token of each row from its logits (greedy, temperature, top_k,
top_p, a format's token mask), drawn from the row's own key so that a request's tokens never
depend on its neighbours; and the tokens' log-probabilities.

Both engines sample here: runner/engine/engine.py (rows of a pre-allocated cache) and
runner/engine/paged_engine.py (a paged cache and one ragged step).
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
    -inf: a format's constraint, applied before temperature, top_k and top_p."""
    return jnp.where(unpacked(masks, logits.shape[-1]), logits.astype(jnp.float32), -jnp.inf)


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


def _candidate_nucleus(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """What `nucleus` keeps, among the CANDIDATES largest logits: (their values and ids [B, C],
    which of them are kept [B, C], and whether that is everything `nucleus` keeps [B])."""
    C = min(CANDIDATES, scaled.shape[-1])
    vals, ids = jax.lax.top_k(scaled, C)  # descending
    last = jnp.min(vals, axis=1, keepdims=True)  # the smallest candidate
    kth = jnp.take_along_axis(vals, jnp.clip(top_k - 1, 0, C - 1)[:, None], axis=1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)  # top_k keeps every logit >= kth
    in_k = vals >= kth
    norm = jnp.where(top_k[:, None] > 0,
                     jax.nn.logsumexp(jnp.where(in_k, vals, -jnp.inf), axis=-1, keepdims=True),
                     jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    p = jnp.where(in_k, jnp.exp(vals - norm), 0)
    # the mass strictly above each value, ties apart, by [C, C] comparisons: any slice of the
    # top_k's values (vals[:, -1:] included) makes XLA:CPU sort the whole vocabulary instead
    above = jnp.sum(jnp.where(vals[:, :, None] > vals[:, None, :], p[:, :, None], 0), axis=1)
    keep = in_k & ((above < top_p[:, None]) | (top_p[:, None] >= 1))
    smallest = jnp.min(jnp.where(keep, vals, jnp.inf), axis=1, keepdims=True)
    # everything kept lies among the candidates when the smallest kept beats the last of them
    fits = (smallest > last)[:, 0] | (C == scaled.shape[-1])
    return vals, ids, keep, fits


def sample(logits: jax.Array | Callable[[], jax.Array], seeds: jax.Array, counts: jax.Array,
           temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
           greedy: jax.Array | None = None) -> jax.Array:
    """Per-row sampling. logits [B, V]; seeds [B] uint32 and counts [B] int32 (the row's key is its
    seed's, folded with the number of tokens it has generated); temperature, top_p [B] f32;
    top_k [B] int32. Where the caller has the greedy tokens [B] already (greedy_screened),
    `logits` may be a function, called only when some row samples.

    temperature 0 is greedy; top_k 0 and top_p 1 disable those filters (see `nucleus`). A sampled
    row draws by Gumbel-max over what `nucleus` keeps, each token's noise from its own key
    (`_gumbel`). The nucleus is looked for among the CANDIDATES largest logits first (one top_k,
    a small fraction of `nucleus`'s passes over the vocabulary); only rows whose nucleus
    reaches past them (top_p 1 with top_k 0: plain sampling) go through `nucleus` and draw over
    the whole vocabulary. Which way a row goes depends on its own logits alone, and both draw a
    token's same noise, so a row's tokens never depend on its neighbours. Keys are derived only
    when some row samples, so a greedy decode step spends nothing on random numbers.
    """
    if greedy is None:
        logits = logits.astype(jnp.float32)
        greedy = greedy_tokens(logits)

    def stochastic() -> jax.Array:
        scaled = (logits() if callable(logits) else logits).astype(jnp.float32)
        scaled = scaled / jnp.maximum(temperature, 1e-6)[:, None]
        keys = jax.vmap(jax.random.fold_in)(jax.vmap(jax.random.key)(seeds), counts)
        vals, ids, keep, fits = _candidate_nucleus(scaled, top_k, top_p)
        pick = jnp.argmax(jnp.where(keep, vals + _gumbel(keys, ids), -jnp.inf), axis=-1)
        drawn = jnp.take_along_axis(ids, pick[:, None], axis=1)[:, 0]

        def whole() -> jax.Array:  # rows whose nucleus reaches past the candidates
            masked = nucleus(scaled, top_k, top_p)
            every = jnp.broadcast_to(jnp.arange(scaled.shape[-1]), scaled.shape)
            return jnp.argmax(masked + _gumbel(keys, every), axis=-1).astype(ids.dtype)

        sampled = temperature > 0
        drawn = jax.lax.cond(jnp.any(sampled & ~fits),
                             lambda: jnp.where(fits, drawn, whole()), lambda: drawn)
        return jnp.where(sampled, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic, lambda: greedy)


def next_tokens(model, rules, policy, weights, out, output, seeds, counts, temperature, top_k,
                top_p, masks=None) -> jax.Array:
    """The next token of each row from a forward pass' last position: `out` is its logits [B, V]
    (output LAST_LOGITS), or its hidden state [B, D] (LAST_HIDDEN, with the greedy screen of
    weights = (params, screen)), whose greedy tokens come through the screen and whose logits are
    made only for rows that sample. masks [B, W]: the tokens each row may take
    (`allowed_tokens`); through the screen, the logits are made only when some row's greedy token
    under its mask is neither the screen's nor forced (`masked_greedy`)."""
    params, screen = weights
    if output is Output.LAST_LOGITS:
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
