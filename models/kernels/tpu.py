"""Pallas TPU kernels: decode_attention with precision.pallas_attention (off by default),
flash_prefill with precision.pallas_prefill (on by default). Checked on CPU in interpret mode
against numpy (tests/test_kernels.py) and compiled for TPU v5e ahead of time (tests/test_compile.py,
python -m runner.tools.compile).

decode_attention: one decode token per row (T = 1) over the KV cache [B, K, S, H], flash-decoding
style. The grid walks (row, kv head, block of cache slots); the block's keys and values are read
from HBM once for all G query heads that share the kv head, with a running max and sum (online
softmax) in VMEM. The last block also takes this step's key and value (not yet in the cache) and the
attention sinks, then normalises. Visibility, windows and sinks as models/attention.attention.

flash_prefill: see its section below.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30  # finite: a block with nothing visible keeps a finite running max


def _block(S: int) -> int:
    """Cache slots per grid step: a multiple of 128 lanes dividing S, else the whole cache."""
    for bs in (512, 256, 128):
        if S % bs == 0:
            return bs
    return S


def _reset(m_ref, l_ref, acc_ref):
    """An online softmax's running max, sum and weighted values, before the first block."""
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _online_update(m_ref, l_ref, acc_ref, scores, seen, v, weight_scale=None):
    """One block of keys into the running max (m), sum (l) and weighted values (acc) of an online
    softmax. scores [rows, n] where `seen`; v [n, H]; weight_scale [1, n] scales each key's weight
    (an int8 cache's value scales)."""
    f32 = jnp.float32
    scores = jnp.where(seen, scores, NEG)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [rows, 1]
    p = jnp.where(seen, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m_prev - m_new)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
    pv = p if weight_scale is None else p * weight_scale
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(pv, v, preferred_element_type=f32)
    m_ref[...] = m_new


def _normalised(m_ref, l_ref, acc_ref, sink=None):
    """The softmax-weighted values, with one more logit per row (`sink` [rows, 1]) that takes
    probability mass and contributes no value; rows that saw nothing give zeros."""
    total, acc = l_ref[...], acc_ref[...]
    if sink is not None:
        m = jnp.maximum(m_ref[...], sink)
        total = total * jnp.exp(m_ref[...] - m) + jnp.exp(sink - m)
        acc = acc * jnp.exp(m_ref[...] - m)
    return acc / jnp.where(total > 0, total, 1.0)


def _kernel(q_pos_ref, new_pos_ref, q_ref, k_ref, v_ref, k_pos_ref, kn_ref, vn_ref, sink_ref,
            *refs, scale: float, window: int, has_sinks: bool, quantized: bool):
    if quantized:  # int8 cache: per-slot scales [1, bs] for the block's keys and values
        ks_ref, vs_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, m_ref, l_ref, acc_ref = refs
    b, s = pl.program_id(0), pl.program_id(2)
    f32 = jnp.float32

    pl.when(s == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    qp = q_pos_ref[b]

    def visible(kp):
        ok = (kp >= 0) & (kp <= qp)
        return ok & (qp - kp < window) if window else ok

    def update(scores, seen, v, v_scale=None):  # scores [G, n], seen [1, n] or [G, n], v [n, H]
        _online_update(m_ref, l_ref, acc_ref, scores, seen, v, v_scale)

    q = q_ref[...].astype(f32)  # [G, H]
    k = k_ref[...].astype(f32)  # [bs, H]
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * scale
    v = v_ref[...].astype(f32)
    if quantized:  # scale each slot's score, and fold each slot's value scale into its weight
        update(scores * ks_ref[...], visible(k_pos_ref[...]), v, vs_ref[...])
    else:
        update(scores, visible(k_pos_ref[...]), v)  # k_pos [1, bs]

    @pl.when(s == pl.num_programs(2) - 1)
    def _finish():
        kn = kn_ref[...].astype(f32)  # [1, H]
        new_scores = jnp.sum(q * kn, axis=1, keepdims=True) * scale  # [G, 1]
        seen = jnp.broadcast_to(visible(new_pos_ref[b]), new_scores.shape)
        update(new_scores, seen, vn_ref[...].astype(f32))
        sink = sink_ref[...].astype(f32) if has_sinks else None  # [G, 1]
        o_ref[...] = _normalised(m_ref, l_ref, acc_ref, sink).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_pos: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, new_pos: jax.Array, q_pos: jax.Array,
                     sinks: jax.Array | None, window: int | None, scale: float,
                     k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                     interpret: bool = False) -> jax.Array:
    """q [B, 1, N, H] at q_pos [B, 1] over the cache (k, v [B, K, S, H], k_pos [B, S]; int8 with
    k_scale, v_scale [B, K, S]) and this step's key (k_new, v_new [B, K, 1, H] at new_pos [B, 1])
    -> [B, 1, N, H]."""
    B, T, N, H = q.shape
    _, K, S, _ = k_cache.shape
    if T != 1:
        raise ValueError(f"the Pallas decode attention takes one query per row, got {T}")
    G = N // K
    bs = _block(S)
    has_sinks = sinks is not None
    sinks = jnp.zeros((N,), jnp.float32) if sinks is None else sinks
    quantized = k_scale is not None
    kernel = functools.partial(_kernel, scale=float(scale), window=int(window or 0),
                               has_sinks=has_sinks, quantized=quantized)
    slot_scales = [pl.BlockSpec((None, None, 1, bs), lambda b, k, s, *_: (b, k, 0, s))] * 2
    extra = (k_scale.reshape(B, K, 1, S), v_scale.reshape(B, K, 1, S)) if quantized else ()
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(B, K, S // bs),
        in_specs=[
            pl.BlockSpec((None, None, G, H), lambda b, k, s, *_: (b, k, 0, 0)),  # q [B, K, G, H]
            pl.BlockSpec((None, None, bs, H), lambda b, k, s, *_: (b, k, s, 0)),  # k cache
            pl.BlockSpec((None, None, bs, H), lambda b, k, s, *_: (b, k, s, 0)),  # v cache
            pl.BlockSpec((None, 1, bs), lambda b, k, s, *_: (b, 0, s)),  # k_pos [B, 1, S]
            pl.BlockSpec((None, None, 1, H), lambda b, k, s, *_: (b, k, 0, 0)),  # k new
            pl.BlockSpec((None, None, 1, H), lambda b, k, s, *_: (b, k, 0, 0)),  # v new
            pl.BlockSpec((None, G, 1), lambda b, k, s, *_: (k, 0, 0)),  # sinks [K, G, 1]
        ] + (slot_scales if quantized else []),
        out_specs=pl.BlockSpec((None, None, G, H), lambda b, k, s, *_: (b, k, 0, 0)),
        scratch_shapes=[pltpu.VMEM((G, 1), jnp.float32), pltpu.VMEM((G, 1), jnp.float32),
                        pltpu.VMEM((G, H), jnp.float32)],
    )
    out = pl.pallas_call(
        kernel, grid_spec=grid, interpret=interpret,
        out_shape=jax.ShapeDtypeStruct((B, K, G, H), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(q_pos[:, 0].astype(jnp.int32), new_pos[:, 0].astype(jnp.int32),
      q.reshape(B, K, G, H), k_cache, v_cache, k_pos.astype(jnp.int32).reshape(B, 1, S),
      k_new, v_new, sinks.astype(jnp.float32).reshape(K, G, 1), *extra)
    return out.reshape(B, 1, N, H)


# --- prefill: flash attention over a prompt's own keys ---------------------------------------
#
# flash_prefill: the queries of a prompt [B, T, N, H] over its own keys [B, K, T, H] (a prefill
# into an empty cache), without the [T, T] scores in HBM. The grid walks (row, kv head, block of
# query positions, block of key positions); a kv head's G query heads ride along as rows of the
# query block (rows = positions x G), so each key block is read once for all of them. Scores,
# running max and sum stay in VMEM (online softmax); the last key block adds the sinks and
# normalises. Blocks that no query of the block can see are skipped: prompts are laid out with
# positions increasing along T (left padding at -1 first), so a key block after the query block,
# or wholly behind its window, holds nothing visible.


def _prefill_blocks(T: int, G: int) -> tuple[int, int]:
    """(query positions, key positions) per grid step: multiples of 128 dividing T, the query
    block's rows (positions x G) at most 1024 so that its [rows, keys] scores fit VMEM (16 MiB of
    scoped VMEM on v5e; 512 positions x 8 heads overflowed it); T itself when 128 does not divide."""
    sizes = [b for b in (512, 256, 128) if T % b == 0]
    if not sizes:
        return T, T
    bq = next((b for b in sizes if b * G <= 1024), sizes[-1])
    return bq, sizes[0]


def _prefill_kernel(q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, sink_ref, o_ref, m_ref, l_ref,
                    acc_ref, *, scale: float, window: int, has_sinks: bool, bq: int, bk: int):
    i, j = pl.program_id(2), pl.program_id(3)
    f32 = jnp.float32

    pl.when(j == 0)(lambda: _reset(m_ref, l_ref, acc_ref))

    run = j * bk <= i * bq + bq - 1  # some key of the block is not after every query
    if window:  # and some key is within the window of the block's first query
        run = jnp.logical_and(run, (j + 1) * bk - 1 >= i * bq - (window - 1))

    @pl.when(run)
    def _step():
        q = q_ref[...].astype(f32)  # [R, H], R = bq * G
        k = k_ref[...].astype(f32)  # [bk, H]
        scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=f32) * scale  # [R, bk]
        qp, kp = q_pos_ref[...], k_pos_ref[...]  # [R, 1], [1, bk]
        seen = (kp >= 0) & (kp <= qp)
        if window:
            seen = seen & (qp - kp < window)
        _online_update(m_ref, l_ref, acc_ref, scores, seen, v_ref[...].astype(f32))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        sink = sink_ref[...] if has_sinks else None  # [R, 1]
        o_ref[...] = _normalised(m_ref, l_ref, acc_ref, sink).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret"))
def flash_prefill(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                  sinks: jax.Array | None, window: int | None, scale: float,
                  interpret: bool = False) -> jax.Array:
    """q [B, T, N, H] at q_pos [B, T] over k, v [B, K, T, H] at k_pos [B, T] (-1 = padding;
    positions increasing along T) -> [B, T, N, H]."""
    B, T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    bq, bk = _prefill_blocks(T, G)
    R = bq * G
    has_sinks = sinks is not None
    sinks = jnp.zeros((N,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    # rows r = t * G + g of each kv head's queries
    qr = jnp.transpose(q.reshape(B, T, K, G, H), (0, 2, 1, 3, 4)).reshape(B, K, T * G, H)
    rows_pos = jnp.repeat(q_pos.astype(jnp.int32), G, axis=1).reshape(B, T * G, 1)
    row_sinks = jnp.tile(sinks.reshape(K, 1, G), (1, bq, 1)).reshape(K, R, 1)
    kernel = functools.partial(_prefill_kernel, scale=float(scale), window=int(window or 0),
                               has_sinks=has_sinks, bq=bq, bk=bk)
    out = pl.pallas_call(
        kernel, interpret=interpret,
        grid=(B, K, T // bq, T // bk),
        in_specs=[
            pl.BlockSpec((None, R, 1), lambda b, h, i, j: (b, i, 0)),  # query rows' positions
            pl.BlockSpec((None, 1, bk), lambda b, h, i, j: (b, 0, j)),  # key positions [B, 1, T]
            pl.BlockSpec((None, None, R, H), lambda b, h, i, j: (b, h, i, 0)),  # q rows
            pl.BlockSpec((None, None, bk, H), lambda b, h, i, j: (b, h, j, 0)),  # k
            pl.BlockSpec((None, None, bk, H), lambda b, h, i, j: (b, h, j, 0)),  # v
            pl.BlockSpec((None, R, 1), lambda b, h, i, j: (h, 0, 0)),  # sinks per row
        ],
        out_specs=pl.BlockSpec((None, None, R, H), lambda b, h, i, j: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, T * G, H), q.dtype),
        scratch_shapes=[pltpu.VMEM((R, 1), jnp.float32), pltpu.VMEM((R, 1), jnp.float32),
                        pltpu.VMEM((R, H), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
    )(rows_pos, k_pos.astype(jnp.int32).reshape(B, 1, T), qr, k, v, row_sinks)
    return jnp.transpose(out.reshape(B, K, T, G, H), (0, 2, 1, 3, 4)).reshape(B, T, N, H)
