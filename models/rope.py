"""Rotary position embedding (rotate-half), with Llama 3.1's frequency bands, linear scaling and
YaRN; one table of cos and sin per forward pass, shared by its layers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


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
