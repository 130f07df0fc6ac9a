"""Attention: the core (grouped-query, one softmax over blocks of keys, windows and sinks) and a
layer's attention over its KV cache, in the kernel its backend chose or in XLA.

Einsum legend: B batch, T query positions, S key positions (cache slots), N query heads, K kv heads,
G query heads per kv head (N = K*G), H head_dim.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models.kernels import sharded
from models.kv_cache import KVCache, Mode
from models.policy import Policy
from sharding.rules import Rules

MASKED = -1e30  # finite, so a row with nothing to attend to (a padding query) gives no NaN


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: KVCache, layer: int, mode: Mode, column: jax.Array | int, rules: Rules,
                     policy: Policy, **kw: Any) -> tuple[jax.Array, KVCache]:
    """Attends q [B, T, N, H] over the cache and this pass's k, v [B, T, K, H], then stores them
    from `column` on.

    `cache.write_positions` must already hold this pass's positions. A prefill (Mode.PREFILL, an
    empty cache, column 0) attends to the new keys alone, not to the whole pre-allocated length.
    Otherwise the cache as it was and the new keys are two blocks of one softmax; the slots this
    pass overwrites are masked in the first. Attending over the cache *after* the write would make
    XLA:CPU copy every layer's whole cache on every decode step (the write then has two readers).
    """
    T = q.shape[1]
    if jnp.ndim(column) == 1:  # a column per row
        new_pos = jnp.take_along_axis(cache.pos, column[:, None] + jnp.arange(T), axis=1,
                                      mode="clip")  # [B, T]
    else:
        new_pos = jax.lax.dynamic_slice_in_dim(cache.pos, column, T, axis=1)  # [B, T]
    if mode is Mode.PREFILL:
        if kernel := policy.backend.prompt_attention(kw.get("sinks")):
            out = sharded.prompt_attention(kernel, q, k, v, positions, new_pos, rules, **kw)
            return out, cache.write(layer, k, v, column, rules)
        B, _, K, H = k.shape
        none = jnp.zeros((B, K, 0, H), jnp.float32)
        cached = (none, none, jnp.zeros((B, 0), jnp.int32), None, None)  # no slot to attend to
    else:
        ring = cache.k[layer].shape[2] != cache.pos.shape[1]
        k_pos = cache.ring_pos if ring else cache.pos  # [B, S], this pass's positions written
        S = k_pos.shape[1]
        first = column[:, None] if jnp.ndim(column) == 1 else column
        overwritten = (jnp.arange(S) - first) % S < T  # slots [column, column + T) (mod S on a ring)
        cached = (cache.k[layer], cache.v[layer], jnp.where(overwritten, -1, k_pos),
                  cache.k_scale[layer], cache.v_scale[layer])
    if kernel := policy.backend.cache_attention(q, k, v, cached[0], cached[3]):
        out = sharded.cache_attention(kernel, q, k, v, positions, new_pos, cached, rules, **kw)
        return out, cache.write(layer, k, v, column, rules)
    new = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), new_pos, None, None)  # [B, K, T, H]
    blocks = [cached, new] if cached[0].shape[2] else [new]
    out = attention(q, positions, blocks, policy, **kw)
    return out, cache.write(layer, k, v, column, rules)


def attention(
    q: jax.Array,
    q_pos: jax.Array,
    blocks: list[tuple[jax.Array, jax.Array, jax.Array]],
    policy: Policy,
    *,
    window: int | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention, K/V never repeated, over one softmax across blocks of keys.

    q: [B, T, N, H]; q_pos: [B, T]; each block (k, v [B, K, S, H], k_pos [B, S] (-1 = empty
    slot), k_scale, v_scale [B, K, S] for int8 k, v or None).
    A key is visible when 0 <= k_pos <= q_pos (and q_pos - k_pos < window). Sinks [N], when given,
    are one extra logit per query head that takes probability mass and contributes no value.
    """
    with jax.named_scope("attention"):
        B, T, N, H = q.shape
        K = blocks[0][0].shape[1]
        qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
        scale = 1.0 / math.sqrt(H) if scale is None else scale
        scores = []
        for k, _, k_pos, k_scale, _ in blocks:
            if k_scale is not None:  # int8 keys: scale the scores, slot by slot
                k = k.astype(qg.dtype)
            s = policy.einsum("BTKGH,BKSH->BKGTS", qg, k).astype(jnp.float32) * scale
            if k_scale is not None:
                s = s * k_scale[:, :, None, None, :]
            visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
            if window is not None:
                visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
            scores.append(jnp.where(visible[:, None, None], s, MASKED))
        # one softmax over the blocks, never concatenated (a copy of every block's scores)
        sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1)
        top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
        if sink is not None:
            top = jnp.maximum(top, sink)
        exps = [jnp.exp(s - top) for s in scores]
        total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
        if sink is not None:
            total = total + jnp.exp(sink - top)
        out = 0
        for e, (_, v, _, _, v_scale) in zip(exps, blocks):
            p = e / total
            if v_scale is not None:  # int8 values: fold each slot's scale into its weight
                p, v = p * v_scale[:, :, None, None, :], v.astype(q.dtype)
            out = out + policy.einsum("BKGTS,BKSH->BTKGH", p.astype(v.dtype), v)
        return out.reshape(B, T, N, H)
