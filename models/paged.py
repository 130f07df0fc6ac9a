"""A paged KV cache and attention over it, for one ragged step of many sequences.

The cache is a pool of pages per layer: k, v [G, P, K, S, H], G groups (one per shard of the
batch: a group's sequences, tokens and pages stay on its devices), P pages of S token slots, K kv
heads. A sequence's table names its pages in order: position p lives in page table[p // S], slot
p % S (runner/engine/pages.py hands them out). Positions are a sequence's own, from 0, with no
gap: a key's position follows from where it lies, so the cache keeps none.

A step's tokens [G, T] each belong to one sequence of their group (`rows`, an index into the
group's tables [G, R, M]) at a position (-1: padding, which writes and sees nothing). Every layer
first writes the step's keys and values into their slots, then attends each query over its
sequence's positions up to its own: a decode step's one token per sequence and a prompt's chunk
are the same computation.

Sliding-window layers (GPT-OSS) keep a pool of their own, with a table of their own per
sequence: a sequence gives back the pages that have left every later query's window, so those
layers hold about a window of tokens per sequence, not its whole length. A table entry given back
stays in the table, pointing anywhere: the window masks whatever is there.

The step's layout, which the attention in XLA relies on: tokens [0, R) are one per sequence
(token r of sequence r: a decode step's, or padding), and any tokens after them (a prompt's
chunk) belong to one sequence, rows[:, R]. The kernels (podrun's CPU one) take any layout.

Stacked (for a scan over layers, models/scan.py): with the L layers in periods of p (GPT-OSS
alternates windowed and full layers: p = 2), pool j holds layers j, j + p, ... one after another
along its pages, [G, D * P, K, S, H] with D = L / p: page n of layer j + d * p is page d * P + n.
Period d's layers read their tables offset by d * P (`layer_view`), so each writes and reads its
own pages of the pool in place, through the same kernels, while the scan carries the pools. (A
separate stack axis, [G, D, P, ...], would be reshaped for the kernels, and XLA:CPU copied the
whole pool at each such reshape where a device holds one kv head.)

With the TPU kernels (Backend.pallas_paged) a pool is stored folded, [G, P, K, S // f, f * H]:
f = models/kernels/tpu.fold(H) slots side by side in 128 lanes, the layout those kernels read
without a copy (see there). Everything else reads [G, P, K, S, H] (f = 1).

Einsum legend: G groups, P pages, Q sequences, T queries, S slots, K kv heads, g query heads per kv
head (N = K * g), H head_dim.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec

from models.policy import Policy
from sharding.rules import Rules, constrain

MASKED = -1e30  # finite, so a query with nothing to attend to (padding) gives no NaN
POOL_AXES = ("cache_batch", None, "cache_kv_heads", None, None)  # k, v [G, P, K, S, H]


class PagedCache(NamedTuple):
    """Every layer's page pool, and (during a forward pass) where the step's tokens go.

    k, v: per layer [G, P, K, S, H] (P: the full layers' pages, or the windowed layers'); an int8
    cache (precision.kv_cache="int8") holds them as int8 with k_scale, v_scale [G, P, K, S] (max
    |x| over H / 127), else those are None.
    tables, window_tables [G, R, M] (the full layers' and the windowed layers' pages of each
    sequence), rows [G, T], positions [G, T]: the step's (`at`), None between steps.
    Stacked (`create` with a period p): k[j], v[j] [G, D * P, K, S, H] hold layers j, j + p, ...
    (D of them), each on P pages of its own. first_page, in a `layer_view` of one, gives the page
    each of its layers' pages start at: the tables' entries are offset by it."""

    k: list[jax.Array]
    v: list[jax.Array]
    k_scale: list[jax.Array | None]
    v_scale: list[jax.Array | None]
    tables: jax.Array | None = None
    window_tables: jax.Array | None = None
    rows: jax.Array | None = None
    positions: jax.Array | None = None
    first_page: tuple[jax.Array, ...] | None = None

    @staticmethod
    def fold(policy: Policy, dtype: Any, head_dim: int) -> int:
        """Slots a row of a pool holds: side by side for the TPU kernels (Backend.page_fold)."""
        return policy.backend.page_fold(dtype, head_dim)

    @staticmethod
    def shardings(rules: Rules, num_layers: int, quantized: bool, period: int = 0) -> PagedCache:
        """period > 0: the stacked layout, `period` pools each holding num_layers / period layers."""
        kv = rules.sharding(*POOL_AXES)
        scale = rules.sharding(*POOL_AXES[:-1]) if quantized else None
        n = period or num_layers
        return PagedCache([kv] * n, [kv] * n, [scale] * n, [scale] * n)

    @staticmethod
    def slot_bytes(dtype: Any, head_dim: int) -> int:
        """Bytes one slot of one kv head's keys (or values) takes: an int8 cache adds its scale."""
        return jnp.dtype(dtype).itemsize * head_dim + (4 if jnp.dtype(dtype) == jnp.int8 else 0)

    @staticmethod
    def page_bytes(num_layers: int, kv_heads: int, head_dim: int, page_size: int, dtype: Any,
                   rules: Rules) -> int:
        """Bytes one page of every layer's keys and values takes on a device (kv heads split by
        the rules; an int8 cache with its scales)."""
        heads = -(-kv_heads // rules.shards("cache_kv_heads"))
        return 2 * num_layers * heads * page_size * PagedCache.slot_bytes(dtype, head_dim)

    @staticmethod
    def create(groups: int, pages: int, window_pages: int, page_size: int,
               windows: tuple[int | None, ...], kv_heads: int, head_dim: int, dtype: Any,
               rules: Rules, allocate: bool = True, fold: int = 1, period: int = 0) -> PagedCache:
        """An empty pool (zeros): `pages` pages per group for full-attention layers,
        `window_pages` for those with a window (windows[i]), stored `fold` slots a row (fold 1:
        [G, P, K, S, H]); period > 0: stacked for a scan over layers whose windows repeat with
        that period; with allocate=False its shapes with their shardings."""
        quantized = jnp.dtype(dtype) == jnp.int8
        num_layers = len(windows)
        if page_size % fold:
            raise ValueError(f"generation.page_size={page_size} must be a multiple of {fold} "
                             f"on TPU (slots of {head_dim} that fill 128 lanes)")
        depth = num_layers // period if period else 1  # the layers a pool holds
        shapes = [(groups, depth * (window_pages if w else pages), kv_heads, page_size // fold,
                   fold * head_dim) for w in (windows[:period] if period else windows)]

        def make():
            kv = [jnp.zeros(shape, dtype) for shape in shapes]
            scale = [jnp.zeros(shape[:-1], jnp.float32) if quantized else None for shape in shapes]
            return PagedCache(kv, list(kv), scale, list(scale))

        out = PagedCache.shardings(rules, num_layers, quantized, period)
        if not allocate:
            return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                                jax.eval_shape(make), out)
        return jax.jit(make, out_shardings=out)()

    def at(self, tables: jax.Array, window_tables: jax.Array, rows: jax.Array) -> PagedCache:
        """This pool for a step whose tokens belong to sequences `rows` [G, T] of the tables."""
        return self._replace(tables=tables, window_tables=window_tables, rows=rows)

    def pool(self) -> PagedCache:
        """The pages alone, as the engine keeps them between steps."""
        return self._replace(tables=None, window_tables=None, rows=None, positions=None)

    def layer_view(self, i: jax.Array, depth: int) -> PagedCache:
        """Of a pool stacked `depth` layers deep: period i's layers, whose pages start at
        first_page[j] = i * P in pool j. Its layers write and read their own pages, in place."""
        return self._replace(first_page=tuple(i * (x.shape[1] // depth) for x in self.k))

    def tables_for(self, layer: int, window: int | None) -> jax.Array:
        """The tables of a layer with this window (None: full attention), as entries of its pool."""
        tables = self.tables if window is None else self.window_tables
        return tables if self.first_page is None else tables + self.first_page[layer]

    def write_positions(self, positions: jax.Array) -> PagedCache:
        """Keeps the step's positions [G, T] (-1: padding) for the writes: a token's slot follows
        from its position."""
        return self._replace(positions=positions.astype(jnp.int32))

    def slots(self, tables: jax.Array, pages: int, S: int) -> jax.Array:
        """Each token's slot in its group's pool of `pages` pages of S slots through `tables`,
        page * S + slot [G, T]; pages * S (past the end: a write there is dropped) for padding."""
        P = pages
        pos = jnp.maximum(self.positions, 0)
        table = jax.vmap(lambda t, r: t[r])(tables, self.rows)  # [G, T, M]: each token's
        page = jnp.take_along_axis(table, (pos // S)[:, :, None], axis=2, mode="clip")[:, :, 0]
        return jnp.where(self.positions >= 0, page * S + pos % S, P * S)

    def write(self, layer: int, k: jax.Array, v: jax.Array, rules: Rules,
              window: int | None = None, policy: Policy | None = None) -> PagedCache:
        """Writes one layer's new k, v [G, T, K, H] into their slots (the layer's window picks
        its pool's tables): in the backend's kernel (Backend.write_pages), else a scatter."""
        with jax.named_scope("cache_write"):
            pool = self.k[layer]
            S = pool.shape[3] * pool.shape[4] // k.shape[-1]
            slots = self.slots(self.tables_for(layer, window), pool.shape[1], S)
            ks, vs, kss, vss = list(self.k), list(self.v), list(self.k_scale), list(self.v_scale)
            if policy is not None and (kernel := policy.backend.write_pages(pool.dtype)):
                ks[layer] = _write_kernel(kernel, pool, k, slots, rules)
                vs[layer] = _write_kernel(kernel, vs[layer], v, slots, rules)
                return self._replace(k=ks, v=vs)
            for store, scales, new in ((ks, kss, k), (vs, vss, v)):
                if scales[layer] is not None:  # int8: one scale per slot and head
                    new, scale = quantize_rows(new)
                    scales[layer] = constrain(_scatter(scales[layer], scale, slots), rules,
                                              *POOL_AXES[:-1])
                store[layer] = constrain(_scatter(store[layer], new.astype(store[layer].dtype), slots),
                                         rules, *POOL_AXES)
            return self._replace(k=ks, v=vs, k_scale=kss, v_scale=vss)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> int8 [..., H] and float32 scales [...] = max |x| / 127 (symmetric)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8), scale


def _scatter(pool: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """new [G, T, K, ...] into pool [G, P, K, S, ...] at slots [G, T] (page * S + slot; out of
    range: dropped)."""
    P, S = pool.shape[1], pool.shape[3]

    def one(pool, new, slots):  # [P, K, S, ...], [T, K, ...], [T]
        page, slot = slots // S, slots % S
        page = jnp.where(slots < P * S, page, P)  # past the end: dropped
        return pool.at[page, :, slot].set(new, mode="drop")

    return jax.vmap(one)(pool, new, slots)


def paged_attention(q: jax.Array, cache: PagedCache, layer: int, rules: Rules, policy: Policy,
                    *, window: int | None = None, sinks: jax.Array | None = None,
                    scale: float | None = None) -> jax.Array:
    """Each query of q [G, T, N, H] over its sequence's positions up to its own (the step's keys
    already written), in the backend's kernel or in XLA."""
    kc, vc = cache.k[layer], cache.v[layer]
    ks, vs = cache.k_scale[layer], cache.v_scale[layer]
    if kernel := policy.backend.paged_attention(q, kc, ks):
        return _kernel(kernel, q, kc, vc, ks, vs, cache.tables_for(layer, window), cache, rules,
                       window, sinks, scale)
    return _xla(q, kc, vc, ks, vs, cache.tables_for(layer, window), cache, policy, window, sinks,
                scale)


# Pages a block of XLA's attention reads at once: its temporaries are those of BLOCK_PAGES pages a
# sequence, whatever the sequences' lengths.
BLOCK_PAGES = 8


def _xla(q, kc, vc, ks, vs, tables, cache: PagedCache, policy: Policy, window, sinks, scale
         ) -> jax.Array:
    """Attention in XLA: the first R queries one per sequence, the rest (a chunk) of sequence
    rows[:, R], each over its sequence's pages (tables) in blocks (`_blocked`)."""
    G, T, N, H = q.shape
    R = tables.shape[1]
    K = kc.shape[2]
    scale = H ** -0.5 if scale is None else scale
    run = lambda q, q_pos, tables: _blocked(q.reshape(*q.shape[:3], K, N // K, H), q_pos, tables,
                                            kc, vc, ks, vs, policy, window, sinks, scale)
    pos = cache.positions
    out = run(q[:, :R, None], pos[:, :R, None], tables).reshape(G, R, N, H)  # [G, R, 1, ...]
    if T == R:
        return out
    chunk_table = jax.vmap(lambda t, r: t[r])(tables, cache.rows[:, R])[:, None]  # [G, 1, M]
    chunk = run(q[:, None, R:], pos[:, None, R:], chunk_table)[:, 0]  # [G, T - R, N, H]
    return jnp.concatenate([out, chunk], axis=1)


def _blocked(q, q_pos, tables, kc, vc, ks, vs, policy: Policy, window, sinks, scale) -> jax.Array:
    """q [G, Q, T, K, Gq, H]: Q sequences of T queries each, at q_pos [G, Q, T] (-1: padding),
    over the sequences' pages (tables [G, Q, M]) -> [G, Q, T, K * Gq, H].

    One softmax over blocks of BLOCK_PAGES pages (running max and sum), from the first block any
    query's window reaches to the last any query's position reaches: the temporaries are a
    block's, and the reads end at the longest sequence of the step, not at its table's end."""
    G, Q, T, K, Gq, H = q.shape
    M, S = tables.shape[2], kc.shape[3]
    Bp = min(BLOCK_PAGES, M)
    tables = jnp.pad(tables, ((0, 0), (0, 0), (0, -M % Bp)))
    live = q_pos >= 0
    last = jnp.max(jnp.where(live, q_pos, 0))
    first = jnp.min(jnp.where(live, jnp.maximum(q_pos - window + 1, 0), last)) if window else 0
    f32 = jnp.float32

    def gather(x, pages):  # [G, P, K, S, ...] at pages [G, Q, Bp] -> [G, Q, K, Bp * S, ...]
        x = jax.vmap(lambda pool, p: pool[p])(x, pages)  # [G, Q, Bp, K, S, ...]
        x = jnp.moveaxis(x, 3, 2)
        return x.reshape(G, Q, K, Bp * S, *x.shape[5:])

    def block(b, carry):
        top, total, acc = carry  # [G, Q, K, Gq, T], the same, [G, Q, K, Gq, T, H]
        pages = jax.lax.dynamic_slice_in_dim(tables, b * Bp, Bp, axis=2)
        k, v = gather(kc, pages), gather(vc, pages)
        if ks is not None:  # int8: dequantised slot by slot
            k = k.astype(q.dtype) * gather(ks, pages)[..., None].astype(q.dtype)
            v = v.astype(q.dtype) * gather(vs, pages)[..., None].astype(q.dtype)
        s = policy.einsum("GQTKgH,GQKSH->GQKgTS", q, k).astype(f32) * scale
        k_pos = b * Bp * S + jnp.arange(Bp * S)
        seen = live[..., None] & (k_pos <= q_pos[..., None])  # [G, Q, T, Bp * S]
        if window:
            seen &= q_pos[..., None] - k_pos < window
        seen = seen[:, :, None, None]
        s = jnp.where(seen, s, MASKED)
        new_top = jnp.maximum(top, jnp.max(s, axis=-1))
        p = jnp.where(seen, jnp.exp(s - new_top[..., None]), 0.0)
        fade = jnp.exp(top - new_top)
        acc = acc * fade[..., None] + policy.einsum("GQKgTS,GQKSH->GQKgTH", p.astype(v.dtype),
                                                    v).astype(f32)
        return new_top, total * fade + jnp.sum(p, axis=-1), acc

    shape = (G, Q, K, Gq, T)
    carry = (jnp.full(shape, MASKED, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, H), f32))
    top, total, acc = jax.lax.fori_loop(first // S // Bp, last // S // Bp + 1, block, carry)
    if sinks is not None:  # one more logit per query head, with no value
        sink = sinks.astype(f32).reshape(1, 1, K, Gq, 1)
        new_top = jnp.maximum(top, sink)
        fade = jnp.exp(top - new_top)
        total, acc, top = total * fade + jnp.exp(sink - new_top), acc * fade[..., None], new_top
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # [G, Q, K, Gq, T, H]
    return jnp.moveaxis(out, 4, 2).reshape(G, Q, T, K * Gq, H).astype(q.dtype)


def _kernel(kernel, q, kc, vc, ks, vs, tables, cache: PagedCache, rules: Rules, window, sinks,
            scale):
    """The backend's paged attention `kernel` per group (and kv-head shard) under shard_map."""
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scales = () if ks is None else (ks, vs)

    def local(q, kc, vc, tables, rows, positions, sinks, *scales):  # one group each
        # the pools whole ([1, P, ...]): a bitcast to [P, ...] of a pool just written, XLA fuses
        # with the write and so copies the pool at each step of a one-row decode
        return kernel(q[0], kc, vc, tables[0], rows[0], positions[0],
                      sinks if has_sinks else None, window, scale, *scales)[None]

    args = (q, kc, vc, tables, cache.rows, cache.positions, sinks, *scales)
    if rules.mesh.size == 1:
        return local(*args)
    b, kv = _group_specs(rules, kc)
    specs = (Spec(b, None, kv, None), Spec(b, None, kv, None, None), Spec(b, None, kv, None, None),
             Spec(b, None, None), Spec(b, None), Spec(b, None), Spec(kv),
             *[Spec(b, None, kv, None)] * len(scales))
    return jax.shard_map(local, mesh=rules.mesh, out_specs=specs[0], check_vma=False,
                         in_specs=specs)(*args)


def _group_specs(rules: Rules, pool: jax.Array) -> tuple[Any, Any]:
    """The mesh axes of a pool's groups and kv heads."""
    spec = rules.spec(*POOL_AXES, shape=pool.shape)
    return spec[0], spec[2]


def _write_kernel(kernel, pool: jax.Array, new: jax.Array, slots: jax.Array, rules: Rules
                  ) -> jax.Array:
    """The backend's page-writing `kernel` per group (and kv-head shard) under shard_map."""
    local = lambda pool, new, slots: kernel(pool[0], new[0], slots[0])[None]
    if rules.mesh.size == 1:
        return local(pool, new, slots)
    b, kv = _group_specs(rules, pool)
    pool_spec = Spec(b, None, kv, None, None)
    return jax.shard_map(local, mesh=rules.mesh, out_specs=pool_spec, check_vma=False,
                         in_specs=(pool_spec, Spec(b, None, kv, None), Spec(b, None)))(pool, new, slots)
