"""NVIDIA GPU kernels:
- flash_prefill: a prompt's attention over its own keys in cuDNN's fused attention
  (jax.nn.dot_product_attention), with kernels.cudnn_prefill;
- decode_attention: a decode step's attention over the KV cache in Pallas (Triton), with
  kernels.pallas_attention, the counterpart of the TPU kernel (models/kernels/tpu.py);
- paged_attention: the paged engine's ragged step (decode rows, a prompt's chunk) over pages
  through page tables in Pallas (Triton), with kernels.pallas_attention, the counterpart of
  models/kernels/cpu.paged_attention and tpu.ragged_paged_attention.

flash_prefill keeps a prompt's [T, T] scores out of GPU memory: XLA's attention writes them
(32 heads x 4,096^2 float32 = 2 GiB a layer for a 4,096-token prompt) and reads them back in each
pass of the softmax. Visibility (padding, causality by position, windows) goes in as an additive
bias [B, 1, T, T], finite so that a padding query, which sees nothing, still gets a finite
(unused) row. Causality by index lets the kernel skip the blocks above the diagonal as well: the
engine's prompts are left-padded, their positions increasing along T, so a key after a query by
index is after it by position too. cuDNN's attention has no sinks; models/attention.py keeps
XLA's attention for GPT-OSS's.

decode_attention reads a row's cache only up to its last filled slot. XLA's attention reads every
slot of the cache as allocated (max_prompt_len + max_new_tokens) on every step, for every row;
in a continuous-batching job most rows hold far fewer tokens than that. Flash-decoding: the
grid is (row, kv head, split of the slots); a kv head's G query heads are the rows of one
[G, H] x [H, block] product, so each block of keys is read once for all of them; each program
keeps a running max, sum and output for its split, and a small XLA step merges the splits with
this step's own key and the sinks. Visibility is by position, as in models/attention.attention,
so padding, holes left by prefix sharing, rings and windows need nothing of their own.

paged_attention reads the pages each row holds, as far as its own position; XLA's attention
over pages (models/paged.py) reads every row of a step as far as the step's longest, and gathers
each block of pages before reading it.

All are checked on CPU (tests/test_kernels.py: flash_prefill through the same call with
implementation="xla", the Triton kernels in Pallas' interpreter and lowered to Triton for CUDA),
and on an H100 against XLA's attention by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG = -1e30  # finite, as models/attention.MASKED
IMPLEMENTATION = "cudnn"


def flash_prefill(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                  sinks: jax.Array | None, window: int | None, scale: float,
                  implementation: str = IMPLEMENTATION) -> jax.Array:
    """q [B, T, N, H] at q_pos [B, T] over k, v [B, K, T, H] at k_pos [B, T] (-1 = padding;
    positions increasing along T) -> [B, T, N, H], as models/attention.attention."""
    if sinks is not None:
        raise ValueError("cuDNN's attention takes no sinks")
    visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, T]
    if window:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    bias = jnp.where(visible, 0.0, NEG).astype(q.dtype)[:, None]
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, T, K, H]
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=True,
                                        implementation=implementation)


# --- decode: one query per row over the cache -------------------------------------------------

BLOCK = 64  # slots per step of a program's loop: a [64, H] block of keys and one of values
PROGRAMS = 512  # splits are added until the grid has about this many programs (132 SMs on H100)


def _splits(B: int, K: int, blocks: int, programs: int) -> tuple[int, int]:
    """(splits, blocks per split) of a cache of `blocks` blocks, so that B x K x splits programs
    keep the GPU busy when B x K alone would not (batch 1: 8 kv heads)."""
    want = max(1, min(blocks, -(-programs // (B * K))))
    per = -(-blocks // want)
    return -(-blocks // per), per


def _decode_kernel(bound_ref, q_pos_ref, q_ref, k_ref, v_ref, k_pos_ref, *refs, G: int,
                   scale: float, window: int, per_split: int, slots: int, quantized: bool):
    """One (row, kv head, split): the running max m, sum l and unnormalised output o of the split's
    visible slots below the row's bound, over blocks of BLOCK slots."""
    if quantized:
        k_scale_ref, v_scale_ref, o_ref, m_ref, l_ref = refs
    else:
        o_ref, m_ref, l_ref = refs
    f32 = jnp.float32
    Gp, H = q_ref.shape  # Gp >= G rows of the block; those past G are masked off
    heads = jnp.arange(Gp) < G
    q = plgpu.load(q_ref, mask=heads[:, None], other=0)
    q_pos = q_pos_ref[...]
    first = pl.program_id(2) * per_split
    last = jnp.minimum(first + per_split, pl.cdiv(bound_ref[...], BLOCK))

    def block(i, carry):
        o, m, l = carry
        at = pl.ds(i * BLOCK, BLOCK)
        inside = i * BLOCK + jnp.arange(BLOCK) < slots  # the last block may overhang the cache
        k_pos = plgpu.load(k_pos_ref.at[at], mask=inside, other=-1)
        k = plgpu.load(k_ref.at[at, :], mask=inside[:, None], other=0).astype(q.dtype)
        s = pl.dot(q, k, trans_b=True).astype(f32) * scale  # [Gp, BLOCK]
        if quantized:
            s = s * plgpu.load(k_scale_ref.at[at], mask=inside, other=0)[None, :]
        seen = (k_pos >= 0) & (k_pos <= q_pos)
        if window:
            seen &= q_pos - k_pos < window
        m_next = jnp.maximum(m, jnp.max(jnp.where(seen[None, :], s, NEG), axis=1))
        p = jnp.where(seen[None, :], jnp.exp(s - m_next[:, None]), 0.0)  # [Gp, BLOCK]
        correction = jnp.exp(m - m_next)
        l = correction * l + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[at, :], mask=inside[:, None], other=0)
        if quantized:  # int8 values: each slot's scale folded into its weight
            p = p * plgpu.load(v_scale_ref.at[at], mask=inside, other=0)[None, :]
            v = v.astype(q.dtype)
        return correction[:, None] * o + pl.dot(p.astype(v.dtype), v).astype(f32), m_next, l

    init = (jnp.zeros((Gp, H), f32), jnp.full((Gp,), NEG, f32), jnp.zeros((Gp,), f32))
    o, m, l = jax.lax.fori_loop(first, last, block, init)  # none past the row's bound
    plgpu.store(o_ref, o, mask=heads[:, None])
    plgpu.store(m_ref, m, mask=heads)
    plgpu.store(l_ref, l, mask=heads)


@functools.partial(jax.jit, static_argnames=("window", "scale", "interpret", "programs"))
def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, k_pos: jax.Array,
                     k_new: jax.Array, v_new: jax.Array, new_pos: jax.Array, q_pos: jax.Array,
                     sinks: jax.Array | None, window: int | None, scale: float,
                     k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                     interpret: bool = False, programs: int = PROGRAMS) -> jax.Array:
    """q [B, 1, N, H] at q_pos [B, 1] over the cache (k, v [B, K, S, H], k_pos [B, S]; int8 with
    k_scale, v_scale [B, K, S]) and this step's key (k_new, v_new [B, K, 1, H] at new_pos [B, 1])
    -> [B, 1, N, H], as tpu.decode_attention. `programs`: how many programs the grid aims at."""
    B, T, N, H = q.shape
    _, K, S, _ = k_cache.shape
    if T != 1:
        raise ValueError(f"the Pallas decode attention takes one query per row, got {T}")
    G = N // K
    Gp = max(16, pl.next_power_of_2(G))  # a Triton product's rows: at least 16, a power of two,
    # the block's rows past G masked off (nothing of them is read or written)
    f32 = jnp.float32
    quantized = k_scale is not None
    qg = q.reshape(B, K, G, H)
    k_pos = k_pos.astype(jnp.int32)
    # every visible slot of a row lies below its bound: one past its last filled slot
    bound = jnp.max(jnp.where(k_pos >= 0, jnp.arange(1, S + 1), 0), axis=1).astype(jnp.int32)
    splits, per_split = _splits(B, K, pl.cdiv(S, BLOCK), programs)
    row = lambda b, h, j: (b,)
    whole = lambda b, h, j: (b, h, 0, 0)
    in_specs = [pl.BlockSpec((None,), row), pl.BlockSpec((None,), row),
                pl.BlockSpec((None, None, Gp, H), whole),
                pl.BlockSpec((None, None, S, H), whole), pl.BlockSpec((None, None, S, H), whole),
                pl.BlockSpec((None, S), lambda b, h, j: (b, 0))]
    extra = ()
    if quantized:
        in_specs += [pl.BlockSpec((None, None, S), lambda b, h, j: (b, h, 0))] * 2
        extra = (k_scale.astype(f32), v_scale.astype(f32))
    kernel = functools.partial(_decode_kernel, G=G, scale=float(scale), window=int(window or 0),
                               per_split=per_split, slots=S, quantized=quantized)
    o, m, l = pl.pallas_call(
        kernel, grid=(B, K, splits), in_specs=in_specs, interpret=interpret,
        out_specs=[pl.BlockSpec((None, None, None, Gp, H), lambda b, h, j: (b, h, j, 0, 0)),
                   pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0)),
                   pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, splits, G, H), f32),
                   jax.ShapeDtypeStruct((B, K, splits, G), f32),
                   jax.ShapeDtypeStruct((B, K, splits, G), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
    )(bound, q_pos[:, 0].astype(jnp.int32), qg, k_cache, v_cache, k_pos, *extra)
    # o [B, K, J, G, H], m and l [B, K, J, G]: each split's running output, max and sum
    # the splits, this step's key and the sinks: one softmax
    s_new = jnp.einsum("bkgh,bkh->bkg", qg.astype(f32), k_new[:, :, 0].astype(f32)) * scale
    pos = new_pos[:, 0][:, None, None]
    seen_new = (pos >= 0) & (pos <= q_pos[:, 0][:, None, None])
    if window:
        seen_new &= q_pos[:, 0][:, None, None] - pos < window
    s_new = jnp.where(seen_new, s_new, NEG)
    # this step's key as one more split of one slot: its output its value, its sum 1
    seen = jnp.broadcast_to(seen_new, s_new.shape).astype(f32)  # [B, K, G]
    o = jnp.concatenate([o, (seen[..., None] * v_new.astype(f32))[:, :, None]], axis=2)
    m = jnp.concatenate([m, s_new[:, :, None]], axis=2)
    l = jnp.concatenate([l, seen[:, :, None]], axis=2)
    sink = None if sinks is None else sinks.astype(f32).reshape(K, G)
    return _merged(o, m, l, sink).astype(q.dtype).reshape(B, 1, N, H)


# --- the paged engine: a ragged step's queries over pages ---------------------------------------

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
    """A ragged step's queries q [T, N, H] over pages k_pages, v_pages [P, K, S, H] (int8 with
    k_scale, v_scale [P, K, S]) through tables [R, M], as models/kernels/cpu.paged_attention
    takes them, laid out as the paged engine's steps are: query r < R is sequence r's decode
    token (q_pos -1: none), and the rest, if any, a chunk of sequence rows[R]'s prompt.
    -> [T, N, H] in q's dtype.

    Decode rows run flash-decoding as decode_attention does, over (row, kv head, split); the
    chunk runs blocks of CHUNK_BLOCK (token, head) rows of a kv head, each over its sequence's
    pages once. Each program reads only the pages its queries see: a row's own, up to its own
    position, not the longest row's."""
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
