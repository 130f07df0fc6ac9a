"""Scan over layers (programs.scan_layers): the layers' weights stacked, one loop body compiled.

Unrolled, XLA compiles every layer's ops separately; scanned, it compiles one period of layers
once and loops over it, so compile time no longer grows with depth. The layers must repeat with a
period P (Llama: every layer alike, P = 1; GPT-OSS alternates sliding-window and full attention,
P = 2): params["layer_stack"] is a list of P trees whose leaves hold layers j, j + P, ... stacked
on a leading axis of L / P (never sharded), and the page pools are stacked the same way
(models/paged.PagedCache). The pools ride the loop's carry: each period writes and reads its own
pages of them in place.

Weights are restored, fused and quantised per layer as always, then stacked (`stack`), one weight
name at a time, so the stacking needs memory for one name's layers, not a second model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from models.paged import PagedCache


def period(windows: tuple[int | None, ...]) -> int:
    """The shortest P that divides the layer count and repeats the layers' attention windows."""
    L = len(windows)
    return next(p for p in range(1, L + 1)
                if L % p == 0 and all(windows[i] == windows[i % p] for i in range(L)))


def _stacked_sharding(s: Any) -> Any:
    return NamedSharding(s.mesh, PartitionSpec(None, *s.spec))


def _group(layers: list, P: int) -> list[list]:
    return [layers[j::P] for j in range(P)]


def abstract(tree: dict, P: int) -> dict:
    """A per-layer abstract params tree (ShapeDtypeStructs with shardings) as `stack` gives it."""
    def one(*xs):
        x = xs[0]
        return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype, sharding=_stacked_sharding(x.sharding))

    stack = [jax.tree.map(one, *group) for group in _group(tree["layers"], P)]
    return {**{k: v for k, v in tree.items() if k != "layers"}, "layer_stack": stack}


def _stacked(*xs: jax.Array) -> jax.Array:
    return jnp.stack(xs)


def stack(params: dict, P: int) -> dict:
    """params["layers"] (one tree per layer) as params["layer_stack"]; `params` is consumed."""
    out = []
    for group in _group(params["layers"], P):
        leaves = [jax.tree.flatten(layer) for layer in group]
        treedef = leaves[0][1]
        stacked = []
        for n in range(len(leaves[0][0])):
            xs = [flat[n] for flat, _ in leaves]
            sharding = _stacked_sharding(xs[0].sharding)
            stacked.append(jax.jit(_stacked, out_shardings=sharding)(*xs))
            for x in xs:
                x.delete()
        out.append(jax.tree.unflatten(treedef, stacked))
    return {**{k: v for k, v in params.items() if k != "layers"}, "layer_stack": out}


def run_layers(params: dict, x: jax.Array, cache: PagedCache,
               layer: Callable[[Any, jax.Array, Any, int], tuple[jax.Array, Any]]
               ) -> tuple[jax.Array, PagedCache]:
    """x through every layer: layer(p, x, cache, i) -> (x, cache) applies layer i's weights p.

    Unrolled (params["layers"]) i runs over the layers. Scanned (params["layer_stack"]) i runs over
    one period, 0..P-1, the loop carries the stacked pools, and `cache` is a view of them in which
    period d's layers write and read their own pages (PagedCache.layer_view): the windows of
    layers i and i + P agree, so whatever `layer` derives from i statically holds for every period.
    """
    if "layers" in params:
        for i, p in enumerate(params["layers"]):
            x, cache = layer(p, x, cache, i)
        return x, cache
    groups = params["layer_stack"]
    depth = jax.tree.leaves(groups[0])[0].shape[0]

    def run_period(carry, i):  # period i's weights, one tree per layer of the period
        x, cache = carry
        view = cache.layer_view(i, depth)
        for j, g in enumerate(groups):
            p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), g)
            x, view = layer(p, x, view, j)
        return (x, view._replace(first_page=None)), None

    (x, cache), _ = jax.lax.scan(run_period, (x, cache), jnp.arange(depth))
    return x, cache
