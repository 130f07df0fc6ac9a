"""Layers every architecture shares: precision policy, norms, RoPE, the attention core, the KV cache.

Einsum legend: B batch, T query positions, S key positions (cache slots), D embed, N query heads,
K kv heads, G query heads per kv head (N = K*G), H head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models import panels, quant
from models.backend import Backend
from sharding.rules import Rules, constrain, fit

MASKED = -1e30  # finite, so a row with nothing to attend to (a padding query) gives no NaN


@dataclasses.dataclass(frozen=True)
class Policy:
    """Precision policy: what weights, activations and the KV cache are held in, matmul precision,
    quantisation and the programs' shape (fused, scanned, donated); the kernel switches of the
    config (precision.*), which only `Backend.resolve` reads; and, once `on` a mesh, the backend
    that those switches give there, which every kernel choice asks."""

    params: str = "float32"
    activations: str = "float32"
    kv_cache: str = "float32"
    matmul: str = "highest"  # default | high | highest (jax.lax.Precision names)
    quantize: str = "none"  # none | int8 | int4 (weight-only: models/quant.py)
    # The kernel switches (models/backend.py says what each gives on which platform):
    kernels: bool = True  # podrun's own kernels (models/kernels) where they apply, else XLA's
    # TPU decode attention in Pallas (models/kernels/tpu.py). Off by default: XLA then copies each
    # layer's cache on every step, as the kernel reads it while the write updates it in place
    # (GPT-OSS-20B on v5e: 3.8 GiB of decode temporaries against 0.6 with XLA's attention).
    pallas_attention: bool = False
    # q/k/v as one product and gate/up as another (models/fused.py), fused after restore.
    fuse_projections: bool = False
    # One loop over stacked layers instead of unrolled ones (models/scan.py), the cache stacked too.
    scan_layers: bool = False
    # TPU prefill attention in the Pallas flash kernel (models/kernels/tpu.flash_prefill).
    pallas_prefill: bool = True
    # NVIDIA GPUs: prefill attention in cuDNN's flash kernel (models/kernels/gpu.py); not with sinks.
    cudnn_prefill: bool = False
    # TPU: GPT-OSS's experts over many tokens as ragged groups of a Pallas grouped matmul.
    pallas_moe: bool = False
    # The engine donates the KV cache to every prefill and decode call, which then update it in
    # place; without, each call writes a new cache and the old one lives until it returns.
    donate_cache: bool = True
    # CPU: the engine moves its weights and KV cache onto 2 MiB pages (runner/engine/hugepages.py).
    huge_pages: bool = True
    # CPU, one device: greedy tokens through an int8 screen of a float32 unembedding, which reads
    # a quarter of its bytes and gives the same tokens (models/kernels/cpu.greedy_screened).
    greedy_screen: bool = True
    # CPU, one device, float32: the projections held in column panels (models/panels.py), which
    # podrun's product kernel reads as one stream a thread, in decode steps and prefills.
    panel_weights: bool = True
    # What the switches give on the mesh computed on: set by `on` (not a config field).
    backend: Backend = Backend()

    def on(self, rules: Rules) -> Policy:
        """This policy for computations on `rules`' mesh: its backend resolved there."""
        backend = Backend.resolve(self, rules)
        return self if backend == self.backend else dataclasses.replace(self, backend=backend)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(self.activations)

    @property
    def precision(self) -> jax.lax.Precision:
        return jax.lax.Precision[self.matmul.upper()]

    def einsum(self, spec: str, *operands: jax.Array) -> jax.Array:
        """jnp.einsum, except that a projection by a weight runs as one plain matrix product.

        A projection contracts the trailing letters of the activation with the leading (or
        trailing) letters of the weight: "BTNH,NHD->BTD", "BTD,VD->BTV". It runs as
        [..., C] x [C, O] (or [O, C]) with the weight merely reshaped, which XLA:CPU streams as
        is. Left to einsum, XLA may instead transpose a weight inside the decode loop, a copy of
        the whole matrix every step, to suit the layout of a small activation.
        """
        if isinstance(operands[-1], (quant.QWeight, quant.Q4Weight)):  # stored output dims first
            x, w = operands
            return quant.matmul(x, w, len(w.contract_axes), self.precision,
                                self.backend.quant_kernels)
        if isinstance(operands[-1], panels.PanelWeight):
            x, w = operands
            plan = _projection(spec, x.ndim, w.ndim)
            if plan is None:
                raise ValueError(f"{spec}: a weight in panels takes part in projections only")
            return panels.matmul(x, w, plan[0])
        if len(operands) == 2 and (plan := _projection(spec, operands[0].ndim, operands[1].ndim)):
            x, w = operands
            w = w.astype(x.dtype)
            n_free, n_contract, weight_first = plan
            free, contract = x.shape[:n_free], x.shape[n_free:]
            C = math.prod(contract)
            if weight_first:  # w: [*contract, *out]
                out = w.shape[n_contract:]
                w2, dims = w.reshape(C, math.prod(out)), ((x.ndim - n_contract,), (0,))
            else:  # w: [*out, *contract]
                out = w.shape[: w.ndim - n_contract]
                w2, dims = w.reshape(math.prod(out), C), ((x.ndim - n_contract,), (1,))
            rows = math.prod(free)
            if self._product_kernel_applies(rows, x, w):
                from models.kernels import cpu

                y = cpu.matmul_f32(x.reshape(rows, C), w2, w_nk=not weight_first)
            else:
                y = jax.lax.dot_general(x.reshape(*free, C), w2, (dims, ((), ())),
                                        precision=self.precision)
            return y.reshape(*free, *out)
        return jnp.einsum(spec, *operands, precision=self.precision)

    def rms_norm(self, x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
        """rms_norm, in one call of podrun's CPU kernel for a decode step's rows on one CPU
        device (float32; models/kernels/cpu.rms_norm), where XLA:CPU runs it as four small
        operations with gaps between them."""
        if self._product_kernel_applies(math.prod(x.shape[:-1]), x, weight):
            from models.kernels import cpu

            return cpu.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps)

    def _product_kernel_applies(self, rows: int, x: jax.Array, w: jax.Array) -> bool:
        """podrun's float32 product kernel (models/kernels/cpu.matmul_f32) for a decode step's
        projections, where the backend has it: up to PRODUCT_KERNEL_ROWS rows. XLA:CPU's dot runs
        a decode step's small products on one thread; the kernel splits each product over threads
        that spin between products. A prefill's many rows (the kernel reads W once per 8 rows)
        go faster through XLA's dot."""
        return (self.backend.product_kernel and rows <= PRODUCT_KERNEL_ROWS
                and x.dtype == jnp.float32 and w.dtype == jnp.float32)


PRODUCT_KERNEL_ROWS = 8


@functools.cache
def _projection(spec: str, x_ndim: int, w_ndim: int) -> tuple[int, int, bool] | None:
    """(free letters of x, contracted letters, weight's contracted letters lead) when `spec` is
    x[*free, *c] . w[*c, *out] -> [*free, *out] or x[*free, *c] . w[*out, *c] -> [*free, *out];
    None for anything else (batched contractions such as attention's)."""
    inputs, result = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if len(xs) != x_ndim or len(ws) != w_ndim or len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
        return None
    shared = [a for a in xs if a in ws]
    n = len(shared)
    if n == 0 or any(a in result for a in shared) or xs[len(xs) - n:] != "".join(shared):
        return None
    free, out_lead, out_trail = xs[: len(xs) - n], ws[n:], ws[: len(ws) - n]
    if ws[:n] == xs[len(xs) - n:] and result == free + out_lead:
        return len(free), n, True
    if ws[len(ws) - n:] == xs[len(xs) - n:] and result == free + out_trail:
        return len(free), n, False
    return None


class Unembedding(NamedTuple):
    """A model's unembedding: w [V, D] where vocab_first (a tied embedding, read as it is stored),
    else [D, V]. The engine takes it apart from the forward pass (head=False) to pick greedy
    tokens without every logit (models/kernels/cpu.greedy_screened)."""

    w: Any
    vocab_first: bool

    def logits(self, x: jax.Array, rules: Rules, policy: Policy) -> jax.Array:
        """x [B, T, D] -> [B, T, V]."""
        spec = "BTD,VD->BTV" if self.vocab_first else "BTD,DV->BTV"
        return constrain(policy.einsum(spec, x, self.w), rules, "batch", "seq", "act_vocab")


def add_bias(x: jax.Array, b: jax.Array | None) -> jax.Array:
    """x + b, or x where the weight has no bias."""
    return x if b is None else x + b


# --- norms ------------------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * weight, the statistics in f32 (as the reference implementations do)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * weight + bias).astype(x.dtype)


# --- rotary position embedding ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary embedding of the first `dim` features of each head (rotate-half convention)."""

    dim: int
    theta: float
    scaling: tuple[tuple[str, Any], ...] = ()  # HF rope_scaling dict, as sorted items (hashable)

    def inv_freq(self) -> np.ndarray:
        inv = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.float32) / self.dim))
        inv = inv.astype(np.float32)
        s = dict(self.scaling)
        kind = s.get("rope_type", s.get("type", "default"))
        if kind == "default":
            return inv
        if kind == "linear":
            return (inv / s["factor"]).astype(np.float32)
        if kind == "llama3":
            return _llama3_inv_freq(inv, s)
        if kind == "yarn":
            return _yarn_inv_freq(inv, self.dim, self.theta, s)
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3, yarn)")

    def attention_scaling(self) -> float:
        """YaRN scales cos and sin (so every attention logit) by this; 1 otherwise."""
        s = dict(self.scaling)
        if s.get("rope_type", s.get("type")) != "yarn":
            return 1.0
        if s.get("attention_factor") is not None:
            return float(s["attention_factor"])
        return 0.1 * math.log(s["factor"]) + 1.0 if s["factor"] > 1 else 1.0


def _llama3_inv_freq(inv: np.ndarray, s: dict) -> np.ndarray:
    """Llama 3.1 frequency bands: long wavelengths slowed by `factor`, short kept, a smooth ramp between."""
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    slowed = np.where(wavelen > old / lo, inv / factor, inv)
    ramp = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - ramp) * slowed / factor + ramp * slowed
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    return np.where(medium, smoothed, slowed).astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, dim: int, theta: float, s: dict) -> np.ndarray:
    """YaRN (arXiv:2309.00071): interpolate (divide by `factor`) the low frequencies, extrapolate
    (keep) the high ones, with a linear ramp between the dimensions that complete beta_fast and
    beta_slow rotations over the original context."""
    factor, old = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:  # the dimension completing `rotations` turns over `old`
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_for(fast), dim_for(slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return (inv / factor * (1 - keep) + inv * keep).astype(np.float32)


class RopeTable(NamedTuple):
    """cos and sin of a pass's positions [B, T, 1, dim/2], scaled (YaRN), shared by its layers."""

    cos: jax.Array
    sin: jax.Array


def rope_table(positions: jax.Array, rope: Rope, dtype) -> RopeTable:
    """positions [B, T], once per forward pass. cos and sin go through a product with the
    identity (exact), which XLA does not fuse into their consumers: fused, XLA:CPU computes them
    again inside every layer's rotation of q and of k, for each head (an optimization barrier
    does not stop it)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.inv_freq())  # [B, T, dim/2]
    scale = rope.attention_scaling()
    cos = (jnp.cos(angles) * scale)[:, :, None, :].astype(dtype)
    sin = (jnp.sin(angles) * scale)[:, :, None, :].astype(dtype)
    both = jnp.concatenate([cos, sin], axis=-1)
    both = jnp.einsum("BTXD,DE->BTXE", both, jnp.eye(both.shape[-1], dtype=dtype),
                      precision=jax.lax.Precision.HIGHEST)
    return RopeTable(*jnp.split(both, 2, axis=-1))


def apply_rope(x: jax.Array, table: RopeTable) -> jax.Array:
    """x: [B, T, heads, H], its first 2 * dim/2 features rotated (rotate-half)."""
    cos, sin = table.cos.astype(x.dtype), table.sin.astype(x.dtype)
    dim = 2 * cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    x1, x2 = jnp.split(rot, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


# --- KV cache ---------------------------------------------------------------------------------

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

    def write_positions(self, positions: jax.Array, start: jax.Array | int) -> KVCache:
        """positions [B, T] into columns [start, start + T); start may be one per row ([B])."""
        positions = positions.astype(jnp.int32)
        pos = _write_columns(self.pos, positions, start, axis=1, ring=False)
        ring_pos = (_write_columns(self.ring_pos, positions, start, axis=1, ring=True)
                    if self.ring_pos.shape[1] else self.ring_pos)
        return self._replace(pos=pos, ring_pos=ring_pos)

    def insert(self, new: KVCache, rows: jax.Array, rules: Rules) -> KVCache:
        """Rows of `new` (a prefill's cache of R rows, columns [0, T) written) in place of rows
        `rows` [R] of this one (an index of B or more drops that row): each row's columns keep
        their slots, column c in slot c (c % W in a window's ring, as `new` holds them too), and
        every other slot of the row is emptied. The other rows are untouched."""
        S, W = self.pos.shape[1], self.ring_pos.shape[1]
        T = new.pos.shape[1]

        def fill(x, n, axis, value):  # x's axis padded with `value` to n slots
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, n - x.shape[axis])
            return jnp.pad(x, widths, constant_values=value)

        def put(store, x, axis, value, *names):
            x = fill(x.astype(store.dtype), store.shape[axis], axis, value)
            return constrain(store.at[rows].set(x, mode="drop"), rules, *names)

        # a window's ring holds its layer's last W columns; `new` has a ring only when T > W
        new_ring_pos = new.ring_pos if new.ring_pos.shape[1] else new.pos
        pos = put(self.pos, new.pos, 1, -1, "cache_batch", "cache_seq")
        ring_pos = put(self.ring_pos, new_ring_pos[:, -W:] if T > W else new_ring_pos, 1, -1,
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

    def layer_view(self, i: jax.Array) -> KVCache:
        """Of a stacked cache: layers i * P .. i * P + P - 1 as a P-layer cache that records its
        writes (`pending`) for `write_layers`."""
        def pick(x):
            return None if x is None else jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)

        return KVCache([pick(x) for x in self.k], [pick(x) for x in self.v], self.pos, self.ring_pos,
                       [pick(x) for x in self.k_scale], [pick(x) for x in self.v_scale],
                       pending=(None,) * len(self.k))

    def write(self, layer: int, k: jax.Array, v: jax.Array, start: jax.Array | int,
              rules: Rules) -> KVCache:
        """Writes one layer's new k, v [B, T, K, H] for columns [start, start + T)."""
        if self.pending is not None:
            pending = list(self.pending)
            pending[layer] = (k, v)
            return self._replace(pending=tuple(pending))
        return self._store(layer, k, v, start, rules, stacked=False)

    def write_layers(self, pending: tuple, start: jax.Array | int, rules: Rules) -> KVCache:
        """Of a stacked cache: pending[j] = (k, v) [L/P, B, T, K, H], the new columns of layers j,
        j + P, ..., as a scan over layers collected them from `layer_view`s."""
        cache = self
        for j, (k, v) in enumerate(pending):
            cache = cache._store(j, jnp.moveaxis(k, 0, 1), jnp.moveaxis(v, 0, 1), start, rules,
                                 stacked=True)
        return cache

    def _store(self, j: int, k: jax.Array, v: jax.Array, start: jax.Array | int, rules: Rules,
               stacked: bool) -> KVCache:
        """k, v [B, *stack, T, K, H] into entry j, columns [start, start + T)."""
        with jax.named_scope("cache_write"):
            ks, vs, kss, vss = list(self.k), list(self.v), list(self.k_scale), list(self.v_scale)
            stack = (None,) if stacked else ()
            slot_axis = 2 + len(stack)  # of k, v [B, *stack, K, S, H] and scales [B, *stack, K, S]
            ring = ks[j].shape[slot_axis] != self.pos.shape[1]

            def put(store, new):  # new [B, *stack, K, T, ...] into slots [start, start + T)
                return _write_columns(store, new, start, slot_axis, ring)

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


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., H] -> int8 [..., H] and float32 scales [...] = max |x| / 127 (symmetric)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / safe[..., None]), -127, 127).astype(jnp.int8), scale


def _write_columns(store: jax.Array, new: jax.Array, start: jax.Array | int, axis: int,
                   ring: bool) -> jax.Array:
    """new's columns [start, start + T) along `axis` into `store` (a ring: column c in slot c % W).
    start is one column for every row, or one per row ([B], a decode step's single column), as
    rows inserted at different times write at different slots."""
    if jnp.ndim(start) == 1:
        if new.shape[axis] != 1:
            raise ValueError(f"per-row starts write one column, got {new.shape[axis]}")
        slot = start % store.shape[axis] if ring else start
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis - 1)
        return jax.vmap(write)(store, new, slot)
    if ring:
        return _ring_write(store, new, start, axis)
    index = (0,) * axis + (start,) + (0,) * (new.ndim - axis - 1)
    return jax.lax.dynamic_update_slice(store, new, index)


def _ring_write(ring: jax.Array, new: jax.Array, start: jax.Array | int, axis: int) -> jax.Array:
    """Writes columns [start, start + T) of `new` into `ring` (W slots): column c goes to c % W."""
    W, T = ring.shape[axis], new.shape[axis]
    if isinstance(start, int):  # static start (prefill): keep the last W columns, rotated into place
        first = max(start, start + T - W)
        kept = jax.lax.slice_in_dim(new, first - start, T, axis=axis)
        if kept.shape[axis] == W:
            return jnp.roll(kept, first % W, axis=axis)
        index = [0] * ring.ndim
        index[axis] = first % W
        if first % W + kept.shape[axis] <= W:
            return jax.lax.dynamic_update_slice(ring, kept, index)
    elif T == 1:  # one decode step
        index = [0] * ring.ndim
        index[axis] = start % W
        return jax.lax.dynamic_update_slice(ring, new, index)
    if T > W:
        raise ValueError(f"writing {T} columns at a traced start into a ring of {W} slots")
    slots = (start + jnp.arange(T)) % W
    return jnp.moveaxis(jnp.moveaxis(ring, axis, 0).at[slots].set(jnp.moveaxis(new, axis, 0)), 0, axis)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     cache: KVCache, layer: int, start: jax.Array | int, rules: Rules,
                     policy: Policy, **kw: Any) -> tuple[jax.Array, KVCache]:
    """Attends q [B, T, N, H] over the cache and this step's k, v [B, T, K, H], then stores them.

    `cache.write_positions` must already hold this step's positions. A prefill into an empty cache
    (start is the literal 0) attends to the new keys alone, not to the whole pre-allocated length.
    Otherwise the cache as it was and the new keys are two blocks of one softmax; the slots this
    step overwrites are masked in the first. Attending over the cache *after* the write would make
    XLA:CPU copy every layer's whole cache on every decode step (the write then has two readers).
    """
    T = q.shape[1]
    if jnp.ndim(start) == 1:  # a column per row
        new_pos = jnp.take_along_axis(cache.pos, start[:, None] + jnp.arange(T), axis=1,
                                      mode="clip")  # [B, T]
    else:
        new_pos = jax.lax.dynamic_slice_in_dim(cache.pos, start, T, axis=1)  # [B, T]
    if isinstance(start, int) and start == 0:
        if kernel := _flash_prefill(policy, kw.get("sinks")):
            return _prefill_kernel(kernel, q, k, v, positions, new_pos, rules, **kw), cache.write(
                layer, k, v, start, rules)
        B, _, K, H = k.shape
        none = jnp.zeros((B, K, 0, H), jnp.float32)
        cached = (none, none, jnp.zeros((B, 0), jnp.int32), None, None)  # no slot to attend to
    else:
        ring = cache.k[layer].shape[2] != cache.pos.shape[1]
        k_pos = cache.ring_pos if ring else cache.pos  # [B, S], this step's positions written
        S = k_pos.shape[1]
        first = start[:, None] if jnp.ndim(start) == 1 else start
        overwritten = (jnp.arange(S) - first) % S < T  # slots [start, start + T) (mod S on a ring)
        cached = (cache.k[layer], cache.v[layer], jnp.where(overwritten, -1, k_pos),
                  cache.k_scale[layer], cache.v_scale[layer])
    if _attention_kernel_applies(q, k, v, cached, policy):
        out = _attention_kernel(q, k, v, positions, new_pos, cached, rules, policy.backend, **kw)
        return out, cache.write(layer, k, v, start, rules)
    new = (jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), new_pos, None, None)  # [B, K, T, H]
    blocks = [cached, new] if cached[0].shape[2] else [new]
    out = attention(q, positions, blocks, policy, **kw)
    return out, cache.write(layer, k, v, start, rules)


def _attention_kernel_applies(q: jax.Array, k: jax.Array, v: jax.Array, cached: tuple,
                              policy: Policy) -> bool:
    """Whether the backend's attention kernel takes this call: on CPU float32 queries, a decode
    step's few or a whole prompt's over no cache, over a float32 or int8 cache; on TPU (Pallas)
    one query per row over the cache, in any precision."""
    kc, k_scale, S = cached[0], cached[3], cached[0].shape[2]
    if policy.backend.attention_kernel:
        cache_ok = kc.dtype == jnp.float32 or (kc.dtype == jnp.int8 and k_scale is not None)
        return ((q.shape[1] <= 16 or S == 0) and cache_ok
                and all(a.dtype == jnp.float32 for a in (q, k, v)))
    return policy.backend.pallas_decode and q.shape[1] == 1 and S > 0


def _attention_kernel(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                      new_pos: jax.Array, cached: tuple, rules: Rules, backend: Backend, *,
                      window: int | None = None, sinks: jax.Array | None = None,
                      scale: float | None = None) -> jax.Array:
    """`attention` over the cached block and the new keys in the backend's kernel: on CPU through
    XLA's FFI (XLA:CPU spends tens of microseconds on each of a decode step's small attention
    products, and takes a prompt's attention through transposes and masked [T, T] scores), on TPU
    in Pallas (the cache read once per kv head, flash-decoding style). On a sharded mesh it runs
    per (batch, kv-head) shard."""

    kc, vc, k_pos, k_scale, v_scale = cached
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks
    b, kv = rules.spec("cache_batch", "cache_kv_heads", None, None, shape=kc.shape)[:2]
    P = jax.sharding.PartitionSpec
    heads, cache, rows = P(b, None, kv, None), P(b, kv, None, None), P(b, None)
    if backend.attention_kernel:  # CPU: the new keys [B, T, K, H] as they are
        from models.kernels import cpu

        kernel, new = cpu.decode_attention, heads
    else:  # Pallas: [B, K, T, H]
        from models.kernels import tpu

        kernel, new, k, v = tpu.decode_attention, cache, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)

    scales = () if k_scale is None else (k_scale, v_scale)  # an int8 cache's, [B, K, S]

    def local(q, kc, vc, k_pos, kn, vn, new_pos, q_pos, sinks, *scales):
        return kernel(q, kc, vc, k_pos, kn, vn, new_pos, q_pos, sinks if has_sinks else None,
                      window, scale, *scales)

    args = (q, kc, vc, k_pos, k, v, new_pos, q_pos, sinks, *scales)
    if rules.mesh.size == 1:
        return local(*args)
    specs = (heads, cache, cache, rows, new, new, rows, rows, P(kv)) + (P(b, kv, None),) * len(scales)
    if kc.shape[2] == 0:  # a prompt over no cache (CPU; new keys [B, T, K, H]): each shard makes
        # the empty block itself, as jaxlib 0.11's Shardy crashes compiling a shard_map with an
        # operand of size zero
        def local(q, kn, vn, new_pos, q_pos, sinks, _with_cache=local):
            B, _, K, H = kn.shape
            none = jnp.zeros((B, K, 0, H), kc.dtype)
            return _with_cache(q, none, none, jnp.zeros((B, 0), k_pos.dtype), kn, vn, new_pos,
                               q_pos, sinks)

        args, specs = (q, k, v, new_pos, q_pos, sinks), (heads, new, new, rows, rows, P(kv))
    return jax.shard_map(local, mesh=rules.mesh, out_specs=heads, check_vma=False,
                         in_specs=specs)(*args)


def _flash_prefill(policy: Policy, sinks: jax.Array | None):
    """The backend's flash kernel for a prompt's attention over its own keys, or None for XLA's
    attention: Pallas on TPU (models/kernels/tpu.py), cuDNN's on NVIDIA GPUs, which takes no
    sinks (models/kernels/gpu.py). Either keeps a prompt's [T, T] scores out of HBM."""
    if policy.backend.flash_prefill == "pallas":
        from models.kernels import tpu

        return tpu.flash_prefill
    if policy.backend.flash_prefill == "cudnn" and sinks is None:
        from models.kernels import gpu

        return gpu.flash_prefill
    return None


def _prefill_kernel(kernel, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                    k_pos: jax.Array, rules: Rules, *, window: int | None = None,
                    sinks: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """`attention` of a prompt over its own keys in a flash `kernel` (_flash_prefill). On a
    sharded mesh it runs per (batch, kv-head) shard."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    has_sinks = sinks is not None
    sinks = jnp.zeros(q.shape[2:3], jnp.float32) if sinks is None else sinks
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, T, H]

    def local(q, k, v, q_pos, k_pos, sinks):
        return kernel(q, k, v, q_pos, k_pos, sinks if has_sinks else None, window, scale)

    if rules.mesh.size == 1:
        return local(q, k, v, q_pos, k_pos, sinks)
    b, kv = rules.spec("cache_batch", "cache_kv_heads", None, None, shape=k.shape)[:2]
    P = jax.sharding.PartitionSpec
    heads, keys, rows = P(b, None, kv, None), P(b, kv, None, None), P(b, None)
    return jax.shard_map(local, mesh=rules.mesh, out_specs=heads, check_vma=False,
                         in_specs=(heads, keys, keys, rows, rows, P(kv)))(q, k, v, q_pos, k_pos, sinks)


# --- attention core ---------------------------------------------------------------------------

def attention(
    q: jax.Array,
    q_pos: jax.Array,
    blocks: list[tuple[jax.Array, jax.Array, jax.Array]],
    policy: Policy,
    *,
    window: int | None = None,
    sinks: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention, K/V never repeated, over one softmax across blocks of keys.

    q: [B, T, N, H]; q_pos: [B, T]; each block (k, v [B, K, S, H], k_pos [B, S] (-1 = empty
    slot), k_scale, v_scale [B, K, S] for int8 k, v or None).
    A key is visible when 0 <= k_pos <= q_pos (and q_pos - k_pos < window). Sinks [N], when given,
    are one extra logit per query head that takes probability mass and contributes no value.
    """
    with jax.named_scope("attention"):
        B, T, N, H = q.shape
        K = blocks[0][0].shape[1]
        qg = q.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
        scale = 1.0 / math.sqrt(H) if scale is None else scale
        scores = []
        for k, _, k_pos, k_scale, _ in blocks:
            if k_scale is not None:  # int8 keys: scale the scores, slot by slot
                k = k.astype(qg.dtype)
            s = policy.einsum("BTKGH,BKSH->BKGTS", qg, k).astype(jnp.float32) * scale
            if k_scale is not None:
                s = s * k_scale[:, :, None, None, :]
            visible = (k_pos[:, None, :] >= 0) & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
            if window is not None:
                visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
            scores.append(jnp.where(visible[:, None, None], s, MASKED))
        # one softmax over the blocks, never concatenated (a copy of every block's scores)
        sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1)
        top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
        if sink is not None:
            top = jnp.maximum(top, sink)
        exps = [jnp.exp(s - top) for s in scores]
        total = sum(jnp.sum(e, axis=-1, keepdims=True) for e in exps)
        if sink is not None:
            total = total + jnp.exp(sink - top)
        out = 0
        for e, (_, v, _, _, v_scale) in zip(exps, blocks):
            p = e / total
            if v_scale is not None:  # int8 values: fold each slot's scale into its weight
                p, v = p * v_scale[:, :, None, None, :], v.astype(q.dtype)
            out = out + policy.einsum("BKGTS,BKSH->BTKGH", p.astype(v.dtype), v)
        return out.reshape(B, T, N, H)
