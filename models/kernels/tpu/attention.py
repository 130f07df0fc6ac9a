"""The engine's attention over the folded pools (models/paged.py, tpu/common.py).

paged_attention: Q sequences of T queries each (a decode step's rows, T = 1, or a prompt's chunk,
Q = 1) over their pages. The grid walks (sequence, block of its queries); a kv head's query heads
ride along as rows (rows = queries x heads per kv head), so a page is read once for all of them.
Pages are not blocks of the grid: each grid step copies the pages its queries reach from HBM, `bp`
pages at a time, double-buffered, from the first page any query's window reaches to the last page
any query's position reaches. So a step reads what its sequence holds, never its table's length.
Each of the f slots of a row is scored by a copy of the queries placed in its lanes (zeros
elsewhere), and its values accumulate in f sums of 128 lanes, of which the caller keeps the slot's
own H lanes. ragged_paged_attention lays a ragged step (decode rows, then a chunk) out for it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels.tpu.common import div

NEG = -1e30  # finite: a block with nothing visible keeps a finite running max
PAGED_BLOCK_TOKENS = 256  # keys a block of pages holds
PAGED_QUERY_ROWS = 512  # query rows (queries x heads per kv head) per grid step, at most


def _reset(m_ref, l_ref, acc_ref):
    """An online softmax's running max, sum and weighted values, before the first block."""
    m_ref[...] = jnp.full(m_ref.shape, NEG, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _normalised(m_ref, l_ref, acc_ref, sink=None):
    """The softmax-weighted values, with one more logit per row (`sink` [rows, 1]) that takes
    probability mass and contributes no value; rows that saw nothing give zeros."""
    total, acc = l_ref[...], acc_ref[...]
    if sink is not None:
        m = jnp.maximum(m_ref[...], sink)
        total = total * jnp.exp(m_ref[...] - m) + jnp.exp(sink - m)
        acc = acc * jnp.exp(m_ref[...] - m)
    return acc / jnp.where(total > 0, total, 1.0)


def paged_query_block(T: int, heads_per_kv: int) -> int:
    """Queries per grid step: T, halved while it is even and its rows exceed PAGED_QUERY_ROWS."""
    tq = T
    while tq > 1 and tq % 2 == 0 and tq * heads_per_kv > PAGED_QUERY_ROWS:
        tq //= 2
    return tq


def _paged_kernel(first_ref, last_ref, table_ref, q_ref, pos_ref, sink_ref, k_hbm, v_hbm, o_ref,
                  kbuf, vbuf, sem, m_ref, l_ref, acc_ref, *, scale: float, window: int,
                  has_sinks: bool, bp: int, f: int):
    i, j = pl.program_id(0), pl.program_id(1)
    at = i * pl.num_programs(1) + j
    first, last = first_ref[at], last_ref[at]  # positions: the first key and the last any query sees
    P, K, Rp, L = k_hbm.shape  # Rp rows of f slots a page
    S, M = Rp * f, table_ref.shape[1]
    f32 = jnp.float32
    _reset(m_ref, l_ref, acc_ref)

    def copies(b, slot):  # the block's pages, each (k, v) copy with whether its page is needed
        lo, hi = div(first, S), div(last, S)
        for p in range(bp):
            n = b * bp + p
            page = jnp.clip(table_ref[0, jnp.minimum(n, M - 1)], 0, P - 1)
            dst = pl.ds(p * Rp, Rp)
            yield p, (n >= lo) & (n <= hi), (
                pltpu.make_async_copy(k_hbm.at[page], kbuf.at[slot, :, dst], sem.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[page], vbuf.at[slot, :, dst], sem.at[1, slot]))

    def start(b, slot):
        for p, needed, pair in copies(b, slot):
            @pl.when(needed)
            def _():
                for c in pair:
                    c.start()

            @pl.when(jnp.logical_not(needed))  # a page no query sees: zeros, never stale NaNs
            def _():
                vbuf[slot, :, pl.ds(p * Rp, Rp), :] = jnp.zeros((K, Rp, L), vbuf.dtype)

    def wait(b, slot):
        for _, needed, pair in copies(b, slot):
            @pl.when(needed)
            def _():
                for c in pair:
                    c.wait()

    qp = pos_ref[...]  # [rows, 1]
    H = L // f

    def padded(h, u):  # kv head h's queries [rows, H] in the lanes of slot u, zeros in the rest
        q = q_ref[h]
        zeros = lambda n: [jnp.zeros((q.shape[0], n), q.dtype)] if n else []
        parts = zeros(u * H) + [q] + zeros(L - (u + 1) * H)
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else q

    queries = [[padded(h, u) for u in range(f)] for h in range(K)]

    def block(b, carry):
        slot = jax.lax.rem(b - div(first, S * bp), 2)

        @pl.when(b < div(last, S * bp))
        def _():
            start(b + 1, 1 - slot)

        wait(b, slot)
        row_pos = b * bp * S + f * jax.lax.broadcasted_iota(jnp.int32, (1, bp * Rp), 1)
        for h in range(K):
            k, v = kbuf[slot, h], vbuf[slot, h]  # [bp * Rp, L]
            scores, seen = [], []
            for u in range(f):  # the u-th slot of each row
                kp = row_pos + u
                ok = (qp >= 0) & (kp <= qp)
                seen.append(ok & (qp - kp < window) if window else ok)
                scores.append(jnp.where(seen[u], jax.lax.dot_general(
                    queries[h][u], k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * scale,
                    NEG))
            m_prev = m_ref[h]
            m_new = m_prev
            for u in range(f):
                m_new = jnp.maximum(m_new, jnp.max(scores[u], axis=1, keepdims=True))
            alpha = jnp.exp(m_prev - m_new)
            total = alpha * l_ref[h]
            for u in range(f):
                p = jnp.where(seen[u], jnp.exp(scores[u] - m_new), 0.0)
                total = total + jnp.sum(p, axis=1, keepdims=True)
                acc_ref[h, u] = alpha * acc_ref[h, u] + jnp.dot(
                    p.astype(v.dtype), v, preferred_element_type=f32)
            l_ref[h] = total
            m_ref[h] = m_new
        return carry

    @pl.when(last >= 0)
    def _():
        b0 = div(first, S * bp)
        start(b0, 0)
        jax.lax.fori_loop(b0, div(last, S * bp) + 1, block, 0)

    for h in range(K):
        sink = sink_ref[h] if has_sinks else None  # [rows, 1]
        out = 0
        for u in range(f):  # slot u's lanes hold its own keys' values: the rest is another's
            slot = _normalised(m_ref.at[h], l_ref.at[h], acc_ref.at[h, u], sink)
            slot = slot[:, u * H:(u + 1) * H]
            out = out + slot.astype(o_ref.dtype).astype(f32)  # as a sum of the slots' outputs
        o_ref[h] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret"))
def paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array,
                    q_pos: jax.Array, sinks: jax.Array | None, window: int | None, scale: float,
                    interpret: bool = False) -> jax.Array:
    """q [Q, T, N, H]: Q sequences of T queries at q_pos [Q, T] (-1: padding, which gives zeros),
    each over its sequence's positions up to its own, through tables [Q, M] into the folded pool
    k, v [P, K, S // f, f * H] (the step's keys already written) -> [Q, T, N, H]."""
    Q, T, N, H = q.shape
    P, K, Rp, L = k_pool.shape
    f = L // H
    S, G = Rp * f, N // K
    tq = paged_query_block(T, G)
    nq, rows = T // tq, tq * G
    bp = max(1, PAGED_BLOCK_TOKENS // S)
    has_sinks = sinks is not None
    sinks = jnp.zeros((N,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    q_pos = q_pos.astype(jnp.int32)
    blocks = q_pos.reshape(Q, nq, tq)
    live = blocks >= 0
    last = jnp.max(jnp.where(live, blocks, -1), axis=2).reshape(-1)
    reach = jnp.maximum(blocks - window + 1, 0) if window else jnp.zeros_like(blocks)
    first = jnp.min(jnp.where(live, reach, jnp.iinfo(jnp.int32).max), axis=2).reshape(-1)
    first = jnp.where(last >= 0, first, 0)
    # rows r = t * G + g of each kv head's queries; the kernel pads them out to its slots' lanes
    qr = jnp.transpose(q.reshape(Q, T, K, G, H), (0, 2, 1, 3, 4)).reshape(Q, K, T * G, H)
    rows_pos = jnp.repeat(q_pos, G, axis=1).reshape(Q, T * G, 1)
    row_sinks = jnp.tile(sinks.reshape(K, 1, G), (1, tq, 1)).reshape(K, rows, 1)
    kernel = functools.partial(_paged_kernel, scale=float(scale), window=int(window or 0),
                               has_sinks=has_sinks, bp=bp, f=f)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(Q, nq),
        in_specs=[
            pl.BlockSpec((None, 1, tables.shape[1]), lambda i, j, *_: (i, 0, 0),
                         memory_space=pltpu.SMEM),  # the sequence's table [Q, 1, M]
            pl.BlockSpec((None, K, rows, H), lambda i, j, *_: (i, 0, j, 0)),  # query rows
            pl.BlockSpec((None, rows, 1), lambda i, j, *_: (i, j, 0)),  # their positions
            pl.BlockSpec((K, rows, 1), lambda i, j, *_: (0, 0, 0)),  # sinks per row
            pl.BlockSpec(memory_space=pl.ANY),  # k pool, in HBM
            pl.BlockSpec(memory_space=pl.ANY),  # v pool
        ],
        out_specs=pl.BlockSpec((None, K, rows, H), lambda i, j, *_: (i, 0, j, 0)),
        scratch_shapes=[pltpu.VMEM((2, K, bp * Rp, L), k_pool.dtype),
                        pltpu.VMEM((2, K, bp * Rp, L), v_pool.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((K, rows, 1), jnp.float32), pltpu.VMEM((K, rows, 1), jnp.float32),
                        pltpu.VMEM((K, f, rows, L), jnp.float32)],
    )
    # What the kernel reads: the queries (and writes as many outputs), and each sequence's pages
    # once, at most the pool's (a pool is sized for what its rows hold, and a step's rows hold about
    # all of it). XLA would count whole operands, the pool once per layer whatever the rows hold.
    pages = min(Q * tables.shape[1], P)
    keys = pages * S // Q if not window else min(pages * S // Q, window + T)
    cost = pl.CostEstimate(
        flops=4 * Q * T * N * L * keys, transcendentals=Q * T * N * keys,
        bytes_accessed=2 * q.size * q.dtype.itemsize
        + 2 * pages * K * Rp * L * jnp.dtype(k_pool.dtype).itemsize)
    out = pl.pallas_call(
        kernel, grid_spec=grid, interpret=interpret, cost_estimate=cost,
        out_shape=jax.ShapeDtypeStruct((Q, K, T * G, H), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(first, last, tables.astype(jnp.int32)[:, None], qr, rows_pos, row_sinks, k_pool, v_pool)
    return jnp.transpose(out.reshape(Q, K, T, G, H), (0, 2, 1, 3, 4)).reshape(Q, T, N, H)


def ragged_paged_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, tables: jax.Array,
                           rows: jax.Array, q_pos: jax.Array, sinks: jax.Array | None,
                           window: int | None, scale: float) -> jax.Array:
    """A ragged step's queries q [T, N, H] (as cpu.paged_attention takes them) in paged_attention:
    the first R = len(tables) one per sequence (decode rows), the rest a chunk of sequence
    rows[R], each over its sequence's pages -> [T, N, H]. The pools may keep their group's axis
    of one ([1, P, K, S // f, f * H])."""
    k_pool, v_pool = k_pool.reshape(k_pool.shape[-4:]), v_pool.reshape(v_pool.shape[-4:])
    R = tables.shape[0]
    out = paged_attention(q[:R, None], k_pool, v_pool, tables, q_pos[:R, None], sinks, window,
                          scale)[:, 0]  # [R, N, H]
    if q.shape[0] == R:
        return out
    chunk = paged_attention(q[None, R:], k_pool, v_pool, tables[rows[R]][None], q_pos[None, R:],
                            sinks, window, scale)[0]
    return jnp.concatenate([out, chunk], axis=0)
