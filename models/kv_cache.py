"""The KV cache: pre-allocated keys and values per layer, the position each slot holds, and how a
pass writes its columns (a window's ring, int8 with scales, stacked for a scan over layers)."""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sharding.rules import Rules, constrain, fit


class Mode(enum.Enum):
    """How a forward pass meets the cache.

    PREFILL: the cache is empty; the tokens fill columns [0, T) and attend to one another alone,
    never to the whole pre-allocated length (the prompt kernels take this case).
    APPEND: the tokens fill columns from `column` on (the same for every row, or one per row [B]),
    after what the cache holds, and attend to it too: decode steps, a long text fed in chunks.
    """

    PREFILL = "prefill"
    APPEND = "append"


class KVCache(NamedTuple):
    """Pre-allocated keys and values for every layer, and the position each slot holds.

    k, v: per layer [B, K, S, H] for full-attention layers, or [B, K, W, H] for sliding-window
    layers, which keep only the last W columns in a ring (column c lives in slot c % W). Heads
    lead the slots so that attention's products over the cache batch over (B, K) as they lie:
    in [B, S, K, H], XLA:CPU copied every layer's cache into that order on every decode step.
    pos: [B, S] and ring_pos: [B, W] int32, the position held by each slot, -1 when empty (or
    padding). Masks derive from positions alone, so left padding, ragged prompts and the ring's
    wrap-around need no other bookkeeping.
    An int8 cache (precision.kv_cache="int8") holds k, v as int8 with one float32 scale per slot
    and head, k_scale, v_scale [B, K, S] = max |x| over H / 127; otherwise those are None.

    Stacked (for a scan over layers, models/scan.py): with layers in a period of P (GPT-OSS
    alternates windowed and full layers: P = 2), k[j], v[j] hold layers j, j + P, ... as
    [B, L/P, K, S, H] (scales [B, L/P, K, S]); the batch stays first.
    pending, when not None, makes `write` record each layer's new k, v instead of writing them (a
    view of one period of a stacked cache, inside the scan): one write after the scan then stores
    them all.
    """

    k: list[jax.Array]
    v: list[jax.Array]
    pos: jax.Array
    ring_pos: jax.Array  # [B, 0] when no layer is windowed
    k_scale: list[jax.Array | None]
    v_scale: list[jax.Array | None]
    pending: tuple | None = None

    @staticmethod
    def bytes_per_element(dtype: Any, head_dim: int) -> float:
        """Bytes a cached k or v element takes: an int8 cache adds its per-slot scale."""
        size = jnp.dtype(dtype).itemsize
        return size + 4 / head_dim if jnp.dtype(dtype) == jnp.int8 else size

    @staticmethod
    def lengths(length: int, windows: tuple[int | None, ...]) -> tuple[int, ...]:
        """Slots per layer: the window for windowed layers (when shorter), else the full length."""
        return tuple(min(w, length) if w else length for w in windows)

    @staticmethod
    def shardings(rules: Rules, num_layers: int, quantized: bool = False, period: int = 0) -> KVCache:
        """period > 0: the stacked layout, `period` arrays each holding num_layers / period layers."""
        stack = (None,) if period else ()
        kv = rules.sharding("cache_batch", *stack, "cache_kv_heads", "cache_seq", None)
        pos = rules.sharding("cache_batch", "cache_seq")
        scale = (rules.sharding("cache_batch", *stack, "cache_kv_heads", "cache_seq")
                 if quantized else None)
        n = period or num_layers
        return KVCache([kv] * n, [kv] * n, pos, pos, [scale] * n, [scale] * n)

    @staticmethod
    def create(batch: int, length: int, windows: tuple[int | None, ...], kv_heads: int,
               head_dim: int, dtype: Any, rules: Rules, period: int = 0) -> KVCache:
        lengths = KVCache.lengths(length, windows)
        rings = {n for n in lengths if n != length}
        if len(rings) > 1:
            raise ValueError(f"windowed layers must share one window, got {sorted(rings)}")
        ring = rings.pop() if rings else 0
        quantized = jnp.dtype(dtype) == jnp.int8
        stack = (len(lengths) // period,) if period else ()
        groups = lengths[:period] if period else lengths

        def make():
            kv = [jnp.zeros((batch, *stack, kv_heads, n, head_dim), dtype) for n in groups]
            scale = [jnp.zeros((batch, *stack, kv_heads, n), jnp.float32) if quantized else None
                     for n in groups]
            return KVCache(kv, list(kv), jnp.full((batch, length), -1, jnp.int32),
                           jnp.full((batch, ring), -1, jnp.int32), scale, list(scale))

        out = KVCache.shardings(rules, len(lengths), quantized, period)
        # fewer rows than the batch's shards (a prefill of one prompt) are held whole on each
        out = jax.tree.map(lambda sh, x: fit(sh, x.shape), out, jax.eval_shape(make))
        return jax.jit(make, out_shardings=out)()

    def write_positions(self, positions: jax.Array, column: jax.Array | int) -> KVCache:
        """positions [B, T] into columns [column, column + T); column may be one per row ([B])."""
        positions = positions.astype(jnp.int32)
        pos = _write_columns(self.pos, positions, column, axis=1, ring=False)
        ring_pos = (_write_columns(self.ring_pos, positions, column, axis=1, ring=True)
                    if self.ring_pos.shape[1] else self.ring_pos)
        return self._replace(pos=pos, ring_pos=ring_pos)

    def insert(self, new: KVCache, rows: jax.Array, rules: Rules) -> KVCache:
        """Rows of `new` (a prefill's cache of R rows, columns [0, T) written) in place of rows
        `rows` [R] of this one (an index of B or more drops that row): each row's columns keep
        their slots, column c in slot c (c % W in a window's ring), and every other slot of the
        row is emptied. The other rows are untouched. `new`'s windowed layers may be rings of W
        slots or hold every column (KVCache.create with no windows): either way the ring gets
        their last W columns."""
        W = self.ring_pos.shape[1]

        def fill(x, n, axis, value):  # x's axis padded with `value` to n slots
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, n - x.shape[axis])
            return jnp.pad(x, widths, constant_values=value)

        def put(store, x, axis, value, *names):
            if store.shape[axis] == W != self.pos.shape[1]:  # a window's ring
                x = _ringed(x, axis, W)
            x = fill(x.astype(store.dtype), store.shape[axis], axis, value)
            return constrain(store.at[rows].set(x, mode="drop"), rules, *names)

        pos = put(self.pos, new.pos, 1, -1, "cache_batch", "cache_seq")
        ring_pos = put(self.ring_pos, new.ring_pos if new.ring_pos.shape[1] else new.pos, 1, -1,
                       "cache_batch", "cache_seq") if W else self.ring_pos
        stack = (None,) * (self.k[0].ndim - 4)
        kv = ("cache_batch", *stack, "cache_kv_heads", "cache_seq", None)
        ks, vs, kss, vss = [], [], [], []
        for j in range(len(self.k)):
            ks.append(put(self.k[j], new.k[j], -2, 0, *kv))
            vs.append(put(self.v[j], new.v[j], -2, 0, *kv))
            scaled = self.k_scale[j] is not None
            kss.append(put(self.k_scale[j], new.k_scale[j], -1, 0, *kv[:-1]) if scaled else None)
            vss.append(put(self.v_scale[j], new.v_scale[j], -1, 0, *kv[:-1]) if scaled else None)
        return KVCache(ks, vs, pos, ring_pos, kss, vss)

    def columns(self, rows: jax.Array, starts: jax.Array, length: int) -> KVCache:
        """Of a cache whose layers are all full-attention: columns [starts[i], starts[i] + length)
        of row rows[i], for each i of [N], as a cache of N rows and `length` columns (blocks of a
        prompt kept for reuse)."""
        if self.ring_pos.shape[1]:
            raise ValueError("a window's ring keeps only its last columns; take blocks of full layers")

        def take(x, axis):  # x [B, ...] -> [N, ...], `length` slots along `axis`
            if x is None:
                return None
            one = lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, length, axis - 1)
            return jax.vmap(one)(x[rows], starts)

        kv = lambda xs: [take(x, x.ndim - 2) for x in xs]
        scale = lambda xs: [None if x is None else take(x, x.ndim - 1) for x in xs]
        return KVCache(kv(self.k), kv(self.v), take(self.pos, 1), self.ring_pos[rows],
                       scale(self.k_scale), scale(self.v_scale))

    def reordered(self, src: jax.Array) -> KVCache:
        """Of a cache whose layers are all full-attention: each row's columns in the order src
        [B, T] gives (column c of row b from its column src[b, c])."""
        def take(x, from_end):  # along the slot axis, `from_end` axes before the last
            if x is None:
                return None
            return jax.vmap(lambda row, s: jnp.take(row, s, row.ndim - from_end))(x, src)

        return KVCache([take(x, 2) for x in self.k], [take(x, 2) for x in self.v],
                       take(self.pos, 1), self.ring_pos, [take(x, 1) for x in self.k_scale],
                       [take(x, 1) for x in self.v_scale])

    def joined(self, blocks: int) -> KVCache:
        """A cache of R * blocks rows of W columns each as R rows of blocks * W columns (block j of
        row r from row r * blocks + j)."""
        def join(x, axis):
            x = x.reshape(x.shape[0] // blocks, blocks, *x.shape[1:])
            x = jnp.moveaxis(x, 1, axis)  # the blocks beside their slots: [R, ..., blocks, W, ...]
            return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])

        kv = lambda xs: [join(x, x.ndim - 2) for x in xs]
        return KVCache(kv(self.k), kv(self.v), join(self.pos, 1),
                       self.ring_pos.reshape(self.ring_pos.shape[0] // blocks, -1),
                       [None if x is None else join(x, x.ndim - 1) for x in self.k_scale],
                       [None if x is None else join(x, x.ndim - 1) for x in self.v_scale])

    def extended(self, length: int) -> KVCache:
        """This cache (full-attention layers) with empty columns after its own, `length` in all."""
        def pad(x, axis, value=0):
            if x is None:
                return None
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, length - x.shape[axis])
            return jnp.pad(x, widths, constant_values=value)

        return KVCache([pad(x, x.ndim - 2) for x in self.k], [pad(x, x.ndim - 2) for x in self.v],
                       pad(self.pos, 1, -1), self.ring_pos,
                       [None if x is None else pad(x, x.ndim - 1) for x in self.k_scale],
                       [None if x is None else pad(x, x.ndim - 1) for x in self.v_scale])

    def layer_view(self, i: jax.Array) -> KVCache:
        """Of a stacked cache: layers i * P .. i * P + P - 1 as a P-layer cache that records its
        writes (`pending`) for `write_layers`."""
        def pick(x):
            return None if x is None else jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)

        return KVCache([pick(x) for x in self.k], [pick(x) for x in self.v], self.pos, self.ring_pos,
                       [pick(x) for x in self.k_scale], [pick(x) for x in self.v_scale],
                       pending=(None,) * len(self.k))

    def write(self, layer: int, k: jax.Array, v: jax.Array, column: jax.Array | int,
              rules: Rules) -> KVCache:
        """Writes one layer's new k, v [B, T, K, H] for columns [column, column + T)."""
        if self.pending is not None:
            pending = list(self.pending)
            pending[layer] = (k, v)
            return self._replace(pending=tuple(pending))
        return self._store(layer, k, v, column, rules, stacked=False)

    def write_layers(self, pending: tuple, column: jax.Array | int, rules: Rules) -> KVCache:
        """Of a stacked cache: pending[j] = (k, v) [L/P, B, T, K, H], the new columns of layers j,
        j + P, ..., as a scan over layers collected them from `layer_view`s."""
        cache = self
        for j, (k, v) in enumerate(pending):
            cache = cache._store(j, jnp.moveaxis(k, 0, 1), jnp.moveaxis(v, 0, 1), column, rules,
                                 stacked=True)
        return cache

    def _store(self, j: int, k: jax.Array, v: jax.Array, column: jax.Array | int, rules: Rules,
               stacked: bool) -> KVCache:
        """k, v [B, *stack, T, K, H] into entry j, columns [column, column + T)."""
        with jax.named_scope("cache_write"):
            ks, vs, kss, vss = list(self.k), list(self.v), list(self.k_scale), list(self.v_scale)
            stack = (None,) if stacked else ()
            slot_axis = 2 + len(stack)  # of k, v [B, *stack, K, S, H] and scales [B, *stack, K, S]
            ring = ks[j].shape[slot_axis] != self.pos.shape[1]

            def put(store, new):  # new [B, *stack, K, T, ...] into slots [column, column + T)
                return _write_columns(store, new, column, slot_axis, ring)

            for store, scales, new in ((ks, kss, k), (vs, vss, v)):
                new = jnp.swapaxes(new, -3, -2)  # [B, *stack, K, T, H]
                if scales[j] is not None:  # int8: one scale per slot and head
                    new, scale = quantize_rows(new)
                    scales[j] = constrain(put(scales[j], scale), rules, "cache_batch", *stack,
                                          "cache_kv_heads", "cache_seq")
                out = put(store[j], new.astype(store[j].dtype))
                store[j] = constrain(out, rules, "cache_batch", *stack, "cache_kv_heads",
                                     "cache_seq", None)
            return self._replace(k=ks, v=vs, k_scale=kss, v_scale=vss)


def _ringed(x: jax.Array, axis: int, W: int) -> jax.Array:
    """Columns [0, T) along `axis` as a ring of W slots holds them (column c in slot c % W): the
    last W, rotated into place. Fewer than W columns, or a ring already, stay as they are."""
    T = x.shape[axis]
    if T <= W:
        return x
    return jnp.roll(jax.lax.slice_in_dim(x, T - W, T, axis=axis), (T - W) % W, axis=axis)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> int8 [..., H] and float32 scales [...] = max |x| / 127 (symmetric)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8), scale


def _write_columns(store: jax.Array, new: jax.Array, column: jax.Array | int, axis: int,
                   ring: bool) -> jax.Array:
    """new's columns into `store` along `axis` from `column` on (a ring: column c in slot c % W).
    `column` is the first column of every row, or one per row ([B], a decode step's single
    column), as rows inserted at different times write at different columns."""
    if jnp.ndim(column) == 1:
        if new.shape[axis] != 1:
            raise ValueError(f"per-row columns write one column, got {new.shape[axis]}")
        slot = column % store.shape[axis] if ring else column
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis - 1)
        return jax.vmap(write)(store, new, slot)
    if ring:
        return _ring_write(store, new, column, axis)
    index = (0,) * axis + (column,) + (0,) * (new.ndim - axis - 1)
    return jax.lax.dynamic_update_slice(store, new, index)


def _ring_write(ring: jax.Array, new: jax.Array, column: jax.Array | int, axis: int) -> jax.Array:
    """Writes columns [column, column + T) of `new` into `ring` (W slots): column c goes to c % W."""
    W, T = ring.shape[axis], new.shape[axis]
    if isinstance(column, int):  # a static column (prefill): the last W columns, rotated into place
        first = max(column, column + T - W)
        kept = jax.lax.slice_in_dim(new, first - column, T, axis=axis)
        if kept.shape[axis] == W:
            return jnp.roll(kept, first % W, axis=axis)
        index = [0] * ring.ndim
        index[axis] = first % W
        if first % W + kept.shape[axis] <= W:
            return jax.lax.dynamic_update_slice(ring, kept, index)
    elif T == 1:  # one decode step
        index = [0] * ring.ndim
        index[axis] = column % W
        return jax.lax.dynamic_update_slice(ring, new, index)
    if T > W:
        raise ValueError(f"writing {T} columns at a traced column into a ring of {W} slots")
    slots = (column + jnp.arange(T)) % W
    return jnp.moveaxis(jnp.moveaxis(ring, axis, 0).at[slots].set(jnp.moveaxis(new, axis, 0)), 0, axis)
