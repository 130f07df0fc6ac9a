"""What the TPU kernels share: the folded layout of the page pools, and Mosaic's division.

The pools' pages are stored folded: a page of S slots of head_dim H is [K, S // f, f * H], f =
fold(H) slots side by side in a row of 128 lanes (slot s of a page in row s // f, lanes
(s % f) * H on). A head_dim of 64 laid out [.., S, 64] would pad every row to 128 lanes in HBM,
and XLA's default layout for it puts the pages minor-most instead, which the kernels cannot read
without a copy of the whole pool; folded, the default layout is the row-major one the kernels
read, with no padding. A page's [K, S // f, f * H] is contiguous: one copy for every kv head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LANES = 128


def fold(head_dim: int) -> int:
    """Slots a row of the folded pool holds: as many of head_dim as fill 128 lanes (1 for a
    head_dim of 128 or more, or one that does not divide 128)."""
    return LANES // head_dim if head_dim < LANES and LANES % head_dim == 0 else 1


def div(a, b: int):
    """a // b for a >= 0, as Mosaic lowers it (a floor division asks for a sign it does not lower)."""
    return jax.lax.div(a, jnp.int32(b))
