"""The attention kernels over a mesh: each runs per (batch, kv-head) shard under shard_map, or
called as it is on one device."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec

from sharding.rules import Rules


def cache_attention(kernel, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                    new_pos: jax.Array, cached: tuple, rules: Rules, *,
                    window: int | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None) -> jax.Array:
    """Attention (as models/attention.attention) over the cached block and the new keys k, v
    [B, T, K, H] in the backend's `kernel` (Backend.cache_attention): on CPU through XLA's FFI
    (XLA:CPU spends tens of microseconds on each of a decode step's small attention products, and
    takes a prompt's attention through transposes and masked [T, T] scores), on TPU and NVIDIA
    GPUs in Pallas (the cache read once per kv head, flash-decoding style; on GPUs only up to
    each row's last filled slot)."""

    kc, vc, k_pos, k_scale, v_scale = cached
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks
    b, kv = rules.spec("cache_batch", "cache_kv_heads", None, None, shape=kc.shape)[:2]
    heads, cache, rows = Spec(b, None, kv, None), Spec(b, kv, None, None), Spec(b, None)
    scales = () if k_scale is None else (k_scale, v_scale)  # an int8 cache's, [B, K, S]

    def local(q, kc, vc, k_pos, kn, vn, new_pos, q_pos, sinks, *scales):
        return kernel(q, kc, vc, k_pos, kn, vn, new_pos, q_pos, sinks if has_sinks else None,
                      window, scale, *scales)

    args = (q, kc, vc, k_pos, k, v, new_pos, q_pos, sinks, *scales)
    if rules.mesh.size == 1:
        return local(*args)
    specs = (heads, cache, cache, rows, heads, heads, rows, rows, Spec(kv),
             *[Spec(b, kv, None)] * len(scales))
    if kc.shape[2] == 0:  # a prompt over no cache (CPU; new keys [B, T, K, H]): each shard makes
        # the empty block itself, as jaxlib 0.11's Shardy crashes compiling a shard_map with an
        # operand of size zero
        def local(q, kn, vn, new_pos, q_pos, sinks, _with_cache=local):
            B, _, K, H = kn.shape
            none = jnp.zeros((B, K, 0, H), kc.dtype)
            return _with_cache(q, none, none, jnp.zeros((B, 0), k_pos.dtype), kn, vn, new_pos,
                               q_pos, sinks)

        args, specs = (q, k, v, new_pos, q_pos, sinks), (heads, heads, heads, rows, rows, Spec(kv))
    return jax.shard_map(local, mesh=rules.mesh, out_specs=heads, check_vma=False,
                         in_specs=specs)(*args)


def prompt_attention(kernel, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                     k_pos: jax.Array, rules: Rules, *, window: int | None = None,
                     sinks: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """Attention (as models/attention.attention) of a prompt over its own keys in a flash
    `kernel`, Pallas' or cuDNN's."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]

    def local(q, k, v, q_pos, k_pos, sinks):
        return kernel(q, k, v, q_pos, k_pos, sinks if has_sinks else None, window, scale)

    if rules.mesh.size == 1:
        return local(q, k, v, q_pos, k_pos, sinks)
    b, kv = rules.spec("cache_batch", "cache_kv_heads", None, None, shape=k.shape)[:2]
    heads, keys, rows = Spec(b, None, kv, None), Spec(b, kv, None, None), Spec(b, None)
    specs = (heads, keys, keys, rows, rows, Spec(kv))
    return jax.shard_map(local, mesh=rules.mesh, out_specs=heads, check_vma=False,
                         in_specs=specs)(q, k, v, q_pos, k_pos, sinks)
