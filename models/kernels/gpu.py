"""NVIDIA GPU kernels:
- flash_prefill: a prompt's attention over its own keys in cuDNN's fused attention
  (jax.nn.dot_product_attention), with kernels.cudnn_prefill;
- decode_attention: a decode step's attention over the KV cache in Pallas (Triton), with
  kernels.pallas_attention, the counterpart of the TPU kernel (models/kernels/tpu.py).

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

Both are checked on CPU (tests/test_kernels.py: flash_prefill through the same call with
implementation="xla", decode_attention in Pallas' interpreter, and lowered to Triton for CUDA),
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
    top = jnp.maximum(jnp.max(m, axis=2), s_new)  # [B, K, G]
    if sinks is not None:
        sink = sinks.astype(f32).reshape(1, K, G)
        top = jnp.maximum(top, sink)
    w = jnp.exp(m - top[:, :, None])  # [B, K, J, G]
    w_new = jnp.where(seen_new, jnp.exp(s_new - top), 0.0)
    total = jnp.sum(l * w, axis=2) + w_new
    if sinks is not None:
        total = total + jnp.exp(sink - top)
    out = jnp.sum(o * w[..., None], axis=2) + w_new[..., None] * v_new[:, :, 0, None].astype(f32)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]  # nothing visible (padding): zeros
    return out.astype(q.dtype).reshape(B, 1, N, H)
