"""One declaration per weight; its sharding, abstract shape and random init all derive from it."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout

from sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Weight:
    """A weight's shape, the logical name of each dimension, and how to initialise it randomly."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # normal | zeros | ones
    scale: float = 0.02
    # A projection's contracted dimensions: n > 0 the first n ([D, N, H] for "BTD,DNH->BTNH"),
    # n < 0 the last -n (an embedding [V, D] used as the unembedding). 0: not a projection.
    # Projections are what precision.quantize stores in int8 (models/quant.py).
    contract: int = 0

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"weight of shape {self.shape} given {len(self.axes)} axis names {self.axes}")


class WeightError(ValueError):
    """A weight does not fit the mesh it is to be sharded over."""


def is_weight(x: Any) -> bool:
    return isinstance(x, Weight)


def _map(fn: Callable[[Weight], Any], decl: Any) -> Any:
    return jax.tree.map(fn, decl, is_leaf=is_weight)


def shardings(decl: Any, rules: Rules) -> Any:
    return _map(lambda w: rules.sharding(*w.axes), decl)


def abstract(decl: Any, rules: Rules, dtype: Any) -> Any:
    """ShapeDtypeStructs carrying their target sharding: what Orbax restores into."""
    return _map(
        lambda w: jax.ShapeDtypeStruct(w.shape, dtype, sharding=rules.sharding(*w.axes)), decl
    )


def init(decl: Any, key: jax.Array, rules: Rules, dtype: Any) -> Any:
    """Random weights, each created directly in its shards, by one small program per distinct
    (shape, init, scale, sharding), which the layers' repeated weights share: one program making
    them all would be a graph of hundreds of random-number generators, slow to compile."""
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    keys = jax.random.split(key, len(leaves))
    made = [_maker(w.shape, w.init, w.scale, jnp.dtype(dtype), rules.sharding(*w.axes))(k)
            for k, w in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, made)


@functools.lru_cache(maxsize=None)
def _maker(shape: tuple[int, ...], init: str, scale: float, dtype: Any, sharding) -> Callable:
    def make(key: jax.Array) -> jax.Array:
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        if init == "ones":
            return jnp.ones(shape, dtype)
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(make, out_shardings=sharding)


def check_divisible(decl: Any, rules: Rules) -> None:
    """Every weight dimension divides evenly over the mesh axes its logical name maps to."""
    for path, w in jax.tree_util.tree_leaves_with_path(decl, is_leaf=is_weight):
        rules.spec(*w.axes)  # refuses a mesh axis used twice
        for size, name in zip(w.shape, w.axes):
            n = rules.shards(name)
            if size % n:
                where = jax.tree_util.keystr(path)
                axes = "*".join(rules.axes(name))
                raise WeightError(
                    f"weight {where} {w.shape}: dimension {name!r} of size {size} does not divide "
                    f"over mesh axes {axes} ({n} shards); change the mesh or the rule for {name!r}"
                )


def is_lookup_table(path: tuple, w: Weight) -> bool:
    """A top-level [rows, D] table that the forward pass only indexes (token or position
    embedding); a tied embedding is also a projection (declared with `contract`) and is read whole."""
    return (len(path) == 1 and len(w.shape) == 2 and w.axes[1] == "embed"
            and w.axes[0] in ("vocab", None) and w.contract == 0)


def pin_tables_row_major(decl: Any, tree: Any) -> Any:
    """Lookup tables (abstract or restored) pinned to row-major, the layout a gather of rows reads
    (a TPU backend's row_major_tables). Left to choose, XLA:TPU laid GPT-OSS's embedding out
    column-major (as it does the unembedding, a product) and copied it back to row-major in every
    decode step: 1.2 GB per chip per step on v5e."""
    def pin(path, w, x):
        if not (is_weight(w) and is_lookup_table(path, w)) or not hasattr(x, "sharding"):
            return x
        fmt = Format(Layout(tuple(range(len(w.shape)))), x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=fmt)
        return jax.device_put(x, fmt)

    return jax.tree_util.tree_map_with_path(pin, decl, tree, is_leaf=is_weight)


def nbytes(decl: Any, dtype: Any) -> int:
    itemsize = np.dtype(dtype).itemsize
    return sum(math.prod(w.shape) * itemsize for w in jax.tree.leaves(decl, is_leaf=is_weight))
