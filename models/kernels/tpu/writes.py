"""The engine's page writes into the folded pools (tpu/common.py): the step's new keys (or
values) into their slots, read-modify-write of each page a token writes (a slot is a part of a
tile, which a copy cannot address alone): a step moves its pages' bytes twice, not a pass over the
pool.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernels.tpu.common import div

WRITE_BLOCK_BYTES = 2 << 20  # a write step's copies of pages in VMEM, at most


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
