"""A mixture of experts' decode step (GPT-OSS's, on v5e and v6e): every local expert's products
in one kernel, each expert's weights read from HBM once."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
