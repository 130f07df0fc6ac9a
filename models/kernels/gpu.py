"""NVIDIA GPU kernels: paged_attention, the engine's ragged step (decode rows, a prompt's
chunk) over pages through page tables in Pallas (Triton), with kernels.pallas_attention, the
counterpart of models/kernels/cpu.paged_attention and tpu.ragged_paged_attention.

It reads the pages each row holds, as far as its own position; XLA's attention over pages
(models/paged.py) reads every row of a step as far as the step's longest, and gathers each block
of pages before reading it. Flash-decoding: a decode row's grid is (row, kv head, split of its
pages); a kv head's G query heads are the rows of one [G, H] x [H, block] product, so each block of
keys is read once for all of them; each program keeps a running max, sum and output for its split,
and a small XLA step merges the splits with the sinks.

Checked on CPU (tests/test_kernels.py: in Pallas' interpreter and lowered to Triton for CUDA), and
on an H100 against XLA's attention by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG = -1e30  # finite, as models/paged.MASKED
PROGRAMS = 512  # splits are added until the grid has about this many programs (132 SMs on H100)


def _splits(B: int, K: int, blocks: int, programs: int) -> tuple[int, int]:
    """(splits, blocks per split) of a row's `blocks` blocks of pages, so that B x K x splits
    programs keep the GPU busy when B x K alone would not (batch 1: 8 kv heads)."""
    want = max(1, min(blocks, -(-programs // (B * K))))
    per = -(-blocks // want)
    return -(-blocks // per), per


PAGE_BLOCK = 64  # slots of a step of a program's loop: PAGE_BLOCK // page_size pages at once
CHUNK_BLOCK = 64  # a chunk program's queries: rows (query token, query head) of one kv head


def _paged_kernel(q_pos_ref, q_ref, table_ref, k_ref, v_ref, *refs, rows: int, per_split: int,
                  window: int, scale: float, quantized: bool, decode: bool):
    """One block of queries of a sequence (decode: a row's G query heads of a kv head; a chunk:
    CHUNK_BLOCK (token, head) rows of a kv head) over one split of its pages: the running max m,
    sum l and unnormalised output o of the visible slots, over steps of PB pages gathered through
    the sequence's table. Only the steps between the first slot any query's window reaches and
    the last slot any query sees are read."""
    if quantized:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    f32 = jnp.float32
    Qb, H = q_ref.shape
    P, S, _ = k_ref.shape
    M = table_ref.shape[0]
    PB = max(1, PAGE_BLOCK // S)
    # rows past G (decode) or past the chunk's last row are masked off
    mine = jnp.arange(Qb) + (0 if decode else pl.program_id(1) * Qb) < rows
    if decode:  # one position for the block
        q_pos = jnp.where(mine, q_pos_ref[...], -1)
    else:
        q_pos = plgpu.load(q_pos_ref, mask=mine, other=-1)
    q = plgpu.load(q_ref, mask=mine[:, None], other=0)
    live = q_pos >= 0
    end = jnp.max(jnp.where(live, q_pos + 1, 0))  # one past the last slot any query sees
    start = jnp.min(jnp.where(live, jnp.maximum(q_pos - window + 1, 0), end)) if window else 0
    first = pl.program_id(2) * per_split if decode else 0  # a chunk's blocks are not split
    lo = jnp.maximum(first, start // (PB * S))
    hi = jnp.minimum(first + per_split, pl.cdiv(end, PB * S))

    def block(i, carry):
        o, m, l = carry
        entries = i * PB + jnp.arange(PB)
        # entries past the sequence's last page may name no page: clipped, and masked below
        at = jnp.clip(plgpu.load(table_ref.at[pl.ds(i * PB, PB)], mask=entries < M, other=0), 0,
                      P - 1)
        k_pos = i * PB * S + jnp.arange(PB * S)
        seen = live[:, None] & (k_pos[None, :] <= q_pos[:, None])  # [Qb, PB * S]
        if window:
            seen &= q_pos[:, None] - k_pos[None, :] < window
        read = (k_pos >= start) & (k_pos < end)  # slots no query sees may hold anything
        k = k_ref[at].reshape(PB * S, H)
        k = jnp.where(read[:, None], k, 0).astype(q.dtype)
        s = pl.dot(q, k, trans_b=True).astype(f32) * scale  # [Qb, PB * S]
        if quantized:
            s = s * jnp.where(read, k_scale_ref[at].reshape(PB * S), 0)[None, :]
        m_next = jnp.maximum(m, jnp.max(jnp.where(seen, s, NEG), axis=1))
        p = jnp.where(seen, jnp.exp(s - m_next[:, None]), 0.0)
        correction = jnp.exp(m - m_next)
        l = correction * l + jnp.sum(p, axis=1)
        v = jnp.where(read[:, None], v_ref[at].reshape(PB * S, H), 0)
        if quantized:  # int8 values: each slot's scale folded into its weight
            p = p * jnp.where(read, v_scale_ref[at].reshape(PB * S), 0)[None, :]
            v = v.astype(q.dtype)
        return correction[:, None] * o + pl.dot(p.astype(v.dtype), v).astype(f32), m_next, l

    init = (jnp.zeros((Qb, H), f32), jnp.full((Qb,), NEG, f32), jnp.zeros((Qb,), f32))
    o, m, l = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), block, init)
    plgpu.store(o_ref, o, mask=mine[:, None])
    plgpu.store(m_ref, m, mask=mine)
    plgpu.store(l_ref, l, mask=mine)


def _merged(o: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The splits' running outputs o [..., J, X, H], maxima and sums m, l [..., J, X] (and a sink
    logit [..., X] per query head, which takes mass and brings no value) as one softmax's output
    [..., X, H] in float32; a query that sees nothing (padding) gives zeros."""
    top = jnp.max(m, axis=-2)
    if sinks is not None:
        top = jnp.maximum(top, sinks)
    w = jnp.exp(m - top[..., None, :])
    total = jnp.sum(l * w, axis=-2)
    if sinks is not None:
        total = total + jnp.exp(sinks - top)
    out = jnp.sum(o * w[..., None], axis=-3)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "programs"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array,
                    rows: jax.Array, q_pos: jax.Array, sinks: jax.Array | None,
                    window: int | None, scale: float, k_scale: jax.Array | None = None,
                    v_scale: jax.Array | None = None, interpret: bool = False,
                    programs: int = PROGRAMS) -> jax.Array:
    """A ragged step's queries q [T, N, H] over pages k_pages, v_pages [P, K, S, H] or one
    group's [1, P, K, S, H] (int8 with k_scale, v_scale [P, K, S] or [1, P, K, S]) through tables [R, M], as models/kernels/cpu.paged_attention
    takes them, laid out as the engine's steps are: query r < R is sequence r's decode
    token (q_pos -1: none), and the rest, if any, a chunk of sequence rows[R]'s prompt.
    -> [T, N, H] in q's dtype.

    Decode rows run flash-decoding, over (row, kv head, split); the chunk runs blocks of
    CHUNK_BLOCK (token, head) rows of a kv head, each over its sequence's pages once. Each program reads only the pages its queries see: a row's own, up to its own
    position, not the longest row's."""
    k_pages, v_pages = k_pages.reshape(k_pages.shape[-4:]), v_pages.reshape(v_pages.shape[-4:])
    if k_scale is not None:
        k_scale, v_scale = k_scale.reshape(k_scale.shape[-3:]), v_scale.reshape(v_scale.shape[-3:])
    T, N, H = q.shape
    P, K, S, _ = k_pages.shape
    R, M = tables.shape
    G = N // K
    f32 = jnp.float32
    quantized = k_scale is not None
    PB = max(1, PAGE_BLOCK // S)
    blocks = pl.cdiv(M, PB)
    window = int(window or 0)
    tables = tables.astype(jnp.int32)
    q_pos = q_pos.astype(jnp.int32)
    scales = (k_scale.astype(f32), v_scale.astype(f32)) if quantized else ()
    sink = None if sinks is None else sinks.astype(f32).reshape(K, G)
    kernel = functools.partial(_paged_kernel, window=window, scale=float(scale),
                               quantized=quantized)
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)

    def pool_specs(head):  # a kv head's pages: [P, S, H], its scales [P, S]
        pool = pl.BlockSpec((P, None, S, H), lambda *g: (0, head(*g), 0, 0))
        scale_spec = pl.BlockSpec((P, None, S), lambda *g: (0, head(*g), 0))
        return [pool, pool] + [scale_spec] * (2 if quantized else 0)

    def outputs(shape, o_index, ml_index, block):
        lead = (None,) * (len(shape) - 1)
        return dict(out_specs=[pl.BlockSpec((*lead, block, H), o_index),
                               pl.BlockSpec((*lead, block), ml_index),
                               pl.BlockSpec((*lead, block), ml_index)],
                    out_shape=[jax.ShapeDtypeStruct((*shape, H), f32),
                               jax.ShapeDtypeStruct(shape, f32), jax.ShapeDtypeStruct(shape, f32)])

    # decode rows: grid (row, kv head, split), a row's G query heads of a kv head in one block
    Gp = max(16, pl.next_power_of_2(G))  # a Triton product's rows: at least 16, a power of two
    splits, per_split = _splits(R, K, blocks, programs)
    o, m, l = pl.pallas_call(
        functools.partial(kernel, rows=G, per_split=per_split, decode=True),
        grid=(R, K, splits), interpret=interpret, compiler_params=params,
        in_specs=[pl.BlockSpec((None,), lambda r, h, j: (r,)),
                  pl.BlockSpec((None, None, Gp, H), lambda r, h, j: (r, h, 0, 0)),
                  pl.BlockSpec((None, M), lambda r, h, j: (r, 0)),
                  *pool_specs(lambda r, h, j: h)],
        **outputs((R, K, splits, G), lambda r, h, j: (r, h, j, 0, 0),
                  lambda r, h, j: (r, h, j, 0), Gp),
    )(q_pos[:R], q[:R].reshape(R, K, G, H), tables, k_pages, v_pages, *scales)
    out = _merged(o, m, l, sink).reshape(R, N, H)  # o [R, K, J, G, H]
    if T == R:
        return out.astype(q.dtype)

    # the chunk: grid (kv head, block of rows), rows (token, query head) of a kv head
    C = T - R
    X = C * G
    qc = jnp.swapaxes(q[R:].reshape(C, K, G, H), 0, 1).reshape(K, X, H)
    pos = jnp.repeat(q_pos[R:], G)  # [X]: row t * G + g is token t's
    o, m, l = pl.pallas_call(
        functools.partial(kernel, rows=X, per_split=blocks, decode=False),
        grid=(K, pl.cdiv(X, CHUNK_BLOCK)), interpret=interpret, compiler_params=params,
        in_specs=[pl.BlockSpec((CHUNK_BLOCK,), lambda h, i: (i,)),
                  pl.BlockSpec((None, CHUNK_BLOCK, H), lambda h, i: (h, i, 0)),
                  pl.BlockSpec((None, M), lambda h, i: (0, 0)),
                  *pool_specs(lambda h, i: h)],
        **outputs((K, 1, X), lambda h, i: (h, 0, i, 0), lambda h, i: (h, 0, i), CHUNK_BLOCK),
    )(pos, qc, tables[rows[R]][None], k_pages, v_pages, *scales)
    chunk_sink = None if sink is None else jnp.tile(sink, (1, C))  # [K, X]: row t * G + g's
    chunk = _merged(o, m, l, chunk_sink)  # [K, X, H]
    chunk = jnp.swapaxes(chunk.reshape(K, C, G, H), 0, 1).reshape(C, N, H)
    return jnp.concatenate([out, chunk], axis=0).astype(q.dtype)
