"""NVIDIA GPU kernels: flash_prefill through cuDNN's fused attention (jax.nn.dot_product_attention),
with precision.cudnn_prefill.

A prompt's attention over its own keys without its [T, T] scores in GPU memory: XLA's attention
writes them (32 heads x 4,096^2 float32 = 2 GiB a layer for a 4,096-token prompt) and reads them
back in each pass of the softmax. Visibility (padding, causality by position, windows) goes in as
an additive bias [B, 1, T, T], finite so that a padding query, which sees nothing, still gets a
finite (unused) row. Causality by index lets the kernel skip the blocks above the diagonal as
well: the engine's prompts are left-padded, their positions increasing along T, so a key after a
query by index is after it by position too. cuDNN's attention has no sinks; models/attention.py keeps
XLA's attention for GPT-OSS's.

Checked on CPU through the same call with implementation="xla" (tests/test_kernels.py), and on an
H100 against XLA's attention by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
