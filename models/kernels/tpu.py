"""Pallas TPU kernels, with kernels.enabled: the paged engine's write_pages and paged_attention
(over pools stored folded, models/paged.py), and GPT-OSS's experts (v5e, v6e). Checked on CPU in
interpret mode against numpy (tests/test_kernels.py) and compiled for TPU v5e ahead of time
(tests/test_compile.py, python -m runner.tools.compile).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

NEG = -1e30  # finite: a block with nothing visible keeps a finite running max


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


# --- paged attention: queries over a pool of pages (the paged engine, models/paged.py) ---------
#
# The pool's pages are stored folded: a page of S slots of head_dim H is [K, S // f, f * H], f =
# fold(H) slots side by side in a row of 128 lanes (slot s of a page in row s // f, lanes
# (s % f) * H on). A head_dim of 64 laid out [.., S, 64] would pad every row to 128 lanes in HBM,
# and XLA's default layout for it puts the pages minor-most instead, which the kernels cannot read
# without a copy of the whole pool; folded, the default layout is the row-major one the kernels
# read, with no padding.
#
# paged_attention: Q sequences of T queries each (a decode step's rows, T = 1, or a prompt's chunk,
# Q = 1) over their pages. The grid walks (sequence, block of its queries); a kv head's query heads
# ride along as rows (rows = queries x heads per kv head), so a page is read once for all of them.
# Pages are not blocks of the grid: each grid step copies the pages its queries reach from HBM,
# `bp` pages at a time, double-buffered, from the first page any query's window reaches to the
# last page any query's position reaches. So a step reads what its sequence holds, never its
# table's length. A page's
# [K, S // f, f * H] is contiguous: one copy for every kv head. Each of the f slots of a row is
# scored by a copy of the queries placed in its lanes (zeros elsewhere), and its values accumulate
# in f sums of 128 lanes, of which the caller keeps the slot's own H lanes.
#
# write_pages: the step's new keys (or values) into their slots, read-modify-write of each page a
# token writes (a slot is a part of a tile, which a copy cannot address alone): a step moves its
# pages' bytes twice, not a pass over the pool.

PAGED_BLOCK_TOKENS = 256  # keys a block of pages holds
PAGED_QUERY_ROWS = 512  # query rows (queries x heads per kv head) per grid step, at most
LANES = 128


def fold(head_dim: int) -> int:
    """Slots a row of the folded pool holds: as many of head_dim as fill 128 lanes (1 for a
    head_dim of 128 or more, or one that does not divide 128)."""
    return LANES // head_dim if head_dim < LANES and LANES % head_dim == 0 else 1


def paged_query_block(T: int, heads_per_kv: int) -> int:
    """Queries per grid step: T, halved while it is even and its rows exceed PAGED_QUERY_ROWS."""
    tq = T
    while tq > 1 and tq % 2 == 0 and tq * heads_per_kv > PAGED_QUERY_ROWS:
        tq //= 2
    return tq


def div(a, b: int):
    """a // b for a >= 0, as Mosaic lowers it (a floor division asks for a sign it does not lower)."""
    return jax.lax.div(a, jnp.int32(b))


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
    rows[R], each over its sequence's pages -> [T, N, H]."""
    R = tables.shape[0]
    out = paged_attention(q[:R, None], k_pool, v_pool, tables, q_pos[:R, None], sinks, window,
                          scale)[:, 0]  # [R, N, H]
    if q.shape[0] == R:
        return out
    chunk = paged_attention(q[None, R:], k_pool, v_pool, tables[rows[R]][None], q_pos[None, R:],
                            sinks, window, scale)[0]
    return jnp.concatenate([out, chunk], axis=0)


def _write_kernel(slots_ref, leader_ref, new_ref, pool_in, pool_out, buf, sem, *, size: int,
                  f: int):
    del pool_in  # aliased to pool_out
    _, K, Rp, L = pool_out.shape
    S = Rp * f
    blk = pl.program_id(0)
    TB = new_ref.shape[0]
    H = L // f
    lanes = jax.lax.broadcasted_iota(jnp.int32, (K, Rp, L), 2)
    rows = jax.lax.broadcasted_iota(jnp.int32, (K, Rp, L), 1)

    def token(t):  # (whether it writes, whether it leads its page's writes)
        return slots_ref[blk * TB + t] < size, leader_ref[blk * TB + t] == t

    def page_copy(t, out: bool):
        s = slots_ref[blk * TB + t]
        page = pool_out.at[div(s, S)]
        return pltpu.make_async_copy(buf.at[t], page, sem.at[0]) if out else \
            pltpu.make_async_copy(page, buf.at[t], sem.at[0])

    def each(body, leaders_only=True):
        def step(t, carry):
            writes, leads = token(t)
            pl.when(writes & leads if leaders_only else writes)(lambda: body(t))
            return carry
        jax.lax.fori_loop(0, TB, step, 0)

    each(lambda t: page_copy(t, False).start())  # each page its block writes, read once
    each(lambda t: page_copy(t, False).wait())

    def put(t):  # token t into its slot of its leader's copy of the page
        s = jax.lax.rem(slots_ref[blk * TB + t], jnp.int32(S))
        at = leader_ref[blk * TB + t]
        mine = (rows == div(s, f)) & (div(lanes, H) == jax.lax.rem(s, jnp.int32(f)))
        buf[at] = jnp.where(mine, jnp.broadcast_to(new_ref[t], (K, Rp, L)), buf[at])

    each(put, leaders_only=False)
    each(lambda t: page_copy(t, True).start())
    each(lambda t: page_copy(t, True).wait())


WRITE_BLOCK_BYTES = 2 << 20  # a write step's copies of pages in VMEM, at most


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_pages(pool: jax.Array, new: jax.Array, slots: jax.Array,
                interpret: bool = False) -> jax.Array:
    """new [T, K, H] into the folded pool [P, K, S // f, f * H] at slots [T] (page * S + slot;
    P * S or more: dropped), in place: the pool is donated and aliased. Tokens that write one
    page must lie in one block of the step's tokens or in consecutive ones (a decode step's write
    different pages, a chunk's consecutive slots)."""
    P, K, Rp, L = pool.shape
    T, _, H = new.shape
    f = L // H
    S = Rp * f
    page_bytes = K * max(Rp, 16) * L * 4
    TB = max(1, min(T, WRITE_BLOCK_BYTES // page_bytes))
    while T % TB:
        TB -= 1
    slots = slots.astype(jnp.int32)
    # Each token's leader: the first token of its block that writes the same page.
    page = jnp.where(slots < P * S, slots // S, -1).reshape(T // TB, TB)
    same = (page[:, :, None] == page[:, None, :]) & (page[:, None, :] >= 0)
    leader = jnp.argmax(same, axis=2).astype(jnp.int32).reshape(T)
    wide = jnp.tile(new.astype(pool.dtype), (1, 1, f)).reshape(T, K, 1, L)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(T // TB,),
        in_specs=[pl.BlockSpec((TB, K, 1, L), lambda i, *_: (i, 0, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.VMEM((TB, K, Rp, L), pool.dtype), pltpu.SemaphoreType.DMA((1,))])
    item = jnp.dtype(pool.dtype).itemsize
    return pl.pallas_call(
        functools.partial(_write_kernel, size=P * S, f=f), grid_spec=grid, interpret=interpret,
        out_shape=jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        input_output_aliases={3: 0},  # operands count the scalar prefetch: the pool is the fourth
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0,
                                      bytes_accessed=2 * T * K * Rp * L * item),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
    )(slots, leader, wide, pool)


# --- a mixture of experts' decode step: every local expert's products in one kernel --------------

EXPERT_CHUNK_BYTES = 6 << 20  # an expert's gate, up and down weights streamed a chunk of F at a time
# What the experts kernel may take of VMEM, by chip: v5e and v6e have 128 MiB a core; on other
# chips GPT-OSS's experts stay XLA's
EXPERTS_VMEM_BYTES = {"TPU v5 lite": 64 << 20, "TPU v6 lite": 64 << 20}


def _tiled_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of an array in HBM as TPUs tile it: its minor dimension padded to 128 lanes, the next
    to the sublanes of its dtype's (8 * 4 / itemsize, 128) tile."""
    item = jnp.dtype(dtype).itemsize
    *major, rows, lanes = (1,) * max(0, 2 - len(shape)) + tuple(shape)
    sub = 8 * 4 // item
    return math.prod(major) * -(-rows // sub) * sub * -(-lanes // 128) * 128 * item


def expert_chunk(F: int, D: int, itemsize: int) -> int:
    """Units of F a grid step takes of an expert: the largest divisor of F whose gate, up and down
    rows fit EXPERT_CHUNK_BYTES, a multiple of 16 (a bf16 tile's sublanes); F if none is."""
    fits = [t for t in range(16, F + 1, 16) if F % t == 0 and 3 * t * D * itemsize <= EXPERT_CHUNK_BYTES]
    return max(fits) if fits else F


def experts_vmem_bytes(M: int, C: int, D: int, F: int, itemsize: int) -> int:
    """VMEM the experts kernel needs for M tokens in buckets of C rows (double-buffered blocks,
    the normalised tokens, float32 accumulators and the products of a chunk)."""
    t = expert_chunk(F, D, itemsize)
    blocks = (2 * M * D + 3 * t * D) * itemsize + 2 * 8 * M * 4
    return 2 * blocks + M * D * (itemsize + 4) + C * D * (itemsize + 4) + C * M * 4 + 3 * 4 * C * t


def _row(ref, e):
    """Row e of a small [E, N] block, as [1, N] (a dynamic row of a packed tile is no load)."""
    pick = jax.lax.broadcasted_iota(jnp.int32, ref.shape, 0) == e
    return jnp.sum(jnp.where(pick, ref[...], 0), axis=0, keepdims=True)


def _experts_kernel(xt_ref, norm_ref, slot_ref, share_ref, wgu_ref, bgu_ref, wd_ref, bd_ref, o_ref,
                    xn_ref, rows_ref, y_ref, acc_ref, *, experts: int, chunks: int, eps: float,
                    limit: float, alpha: float):
    e, j = pl.program_id(0), pl.program_id(1)
    f32, dt = jnp.float32, xt_ref.dtype
    C = rows_ref.shape[0]
    nt = (((1,), (1,)), ((), ()))  # a [P, K] . b [Q, K] -> [P, Q]

    @pl.when((e == 0) & (j == 0))
    def _():
        acc_ref[...] = jnp.zeros(acc_ref.shape, f32)
        # the tokens over their root mean square, rounded, as models/norms.rms_norm (its weight
        # multiplies each bucket's rows below)
        x = xt_ref[...].astype(f32)  # [D, M]
        inv = jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + eps)
        xn_ref[...] = (x * inv).astype(dt)

    # the bucket: its slot c holds the token m whose slot is c (none: a row of zeros)
    bucket = jax.lax.broadcasted_iota(jnp.int32, (C, xt_ref.shape[1]), 0) == _row(slot_ref, e)

    @pl.when(j == 0)
    def _():
        y_ref[...] = jnp.zeros(y_ref.shape, f32)
        rows = jax.lax.dot_general(bucket.astype(dt), xn_ref[...], nt, preferred_element_type=f32)
        rows_ref[...] = (rows.astype(dt).astype(f32) * norm_ref[...].astype(f32)).astype(dt)

    rows = rows_ref[...]
    b = bgu_ref[...].astype(f32)  # [2, t]
    # roundings as the XLA path's: each product to the activations' dtype, then its bias, then
    # the activation
    gate = jax.lax.dot_general(rows, wgu_ref[0], nt, preferred_element_type=f32).astype(dt)
    up = jax.lax.dot_general(rows, wgu_ref[1], nt, preferred_element_type=f32).astype(dt)
    gate = (gate.astype(f32) + b[0:1]).astype(dt).astype(f32)
    up = (up.astype(f32) + b[1:2]).astype(dt).astype(f32)
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    h = (gate * jax.nn.sigmoid(alpha * gate) * (up + 1)).astype(dt)  # [C, t]
    y_ref[...] += jnp.dot(h, wd_ref[...], preferred_element_type=f32)  # [C, D]

    @pl.when(j == chunks - 1)
    def _():
        y = (y_ref[...].astype(dt).astype(f32) + _row(bd_ref, e).astype(f32)).astype(dt)  # [C, D]
        # each slot's token's weight of the expert, [C, M]; the tokens' outputs [D, M] += y^T . that
        combine = jnp.where(bucket, _row(share_ref, e).astype(f32), 0.0).astype(dt)
        acc_ref[...] += jax.lax.dot_general(y, combine, (((0,), (0,)), ((), ())),
                                            preferred_element_type=f32)

    @pl.when((e == experts - 1) & (j == chunks - 1))
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("capacity", "eps", "limit", "alpha", "interpret"))
def experts(xt: jax.Array, norm: jax.Array, slot: jax.Array, share: jax.Array, w_gate_up: jax.Array,
            b_gate_up: jax.Array, w_down_t: jax.Array, b_down: jax.Array, *, capacity: int,
            eps: float, limit: float, alpha: float, interpret: bool = False) -> jax.Array:
    """GPT-OSS's mixture of experts on a few tokens after its RMSNorm, each expert's weights read
    from HBM once and nothing else written but the result: out^T [D, M] = sum over experts e
    and tokens m in e's bucket of share[e, m] * y_e(m), where y_e = swiglu(x_n @ w_gate_up[e]^T + b)
    @ w_down_t[e] + b_down[e] and x_n = rms_norm(x) * norm.

    The tokens enter and leave transposed, xt [D, M] and [D, M], as XLA:TPU lays out a decode
    step's activations (tokens minor), unnormalised: the kernel normalises them in VMEM.
    slot [E, M]: token m's place in expert e's bucket of `capacity` rows (any other value: not
    there); share [E, M]: its weight of the expert (0 where it does not go there). norm [D] (the
    RMSNorm's weight); w_gate_up [E, 2, F, D] (gate, then up); b_gate_up [E, 2, F]; w_down_t
    [E, F, D] (the down projection with D minor: a chunk of F is a block of rows); b_down [E, D].
    The grid walks (expert, chunk of F): a step streams a chunk's gate, up and down rows, sums
    their products into the bucket's outputs in VMEM, and the last chunk adds those, weighted,
    into every token's. XLA's path writes each expert's bucket, products and outputs to HBM and
    reads them back."""
    D, M = xt.shape
    E, _, F, _ = w_gate_up.shape
    C = capacity
    item = jnp.dtype(xt.dtype).itemsize
    t = expert_chunk(F, D, item)
    n = F // t
    bgu = jnp.transpose(b_gate_up.reshape(E, 2, n, t), (0, 2, 1, 3))  # [E, n, 2, t]: a block per step
    specs = [pl.BlockSpec((D, M), lambda e, j: (0, 0)),
             pl.BlockSpec((1, D), lambda e, j: (0, 0)),
             pl.BlockSpec((E, M), lambda e, j: (0, 0)),
             pl.BlockSpec((E, M), lambda e, j: (0, 0)),
             pl.BlockSpec((None, 2, t, D), lambda e, j: (e, 0, j, 0)),
             pl.BlockSpec((None, None, 2, t), lambda e, j: (e, j, 0, 0)),
             pl.BlockSpec((None, t, D), lambda e, j: (e, j, 0)),
             pl.BlockSpec((E, D), lambda e, j: (0, 0))]
    operands = [xt, norm.reshape(1, D), slot.astype(jnp.int32), share.astype(jnp.float32), w_gate_up,
                bgu, w_down_t, b_down]
    scratch = [pltpu.VMEM((D, M), xt.dtype), pltpu.VMEM((C, D), xt.dtype),
               pltpu.VMEM((C, D), jnp.float32), pltpu.VMEM((D, M), jnp.float32)]
    flops = 2 * E * C * D * (3 * F + 2 * M)
    read = sum(_tiled_bytes(a.shape, a.dtype) for a in operands)
    cost = pl.CostEstimate(flops=flops, transcendentals=E * C * F + M,
                           bytes_accessed=read + _tiled_bytes((D, M), xt.dtype))
    vmem = experts_vmem_bytes(M, C, D, F, item)
    return pl.pallas_call(
        functools.partial(_experts_kernel, experts=E, chunks=n, eps=float(eps), limit=float(limit),
                          alpha=float(alpha)),
        grid=(E, n), in_specs=specs, out_specs=pl.BlockSpec((D, M), lambda e, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((D, M), xt.dtype), scratch_shapes=scratch,
        interpret=interpret, cost_estimate=cost,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=min(max(EXPERTS_VMEM_BYTES.values()), vmem + vmem // 4 + (4 << 20))),
    )(*operands)
