"""Fused projections (programs.fuse_projections): one matrix product where several read one input.

    q, k, v     wqkv [D, K, J, H], J = G + 2: for each kv head, its G query heads, then its key and
                its value. Sharding the kv heads keeps every group whole, and leaves each shard the
                same query heads as sharding `heads` in wq would.
    gate, up    w_gate_up [D, 2, F]: [:, 0] the gate, [:, 1] the up projection.

Checkpoints hold the separate weights. After a restore, `fuse` builds the fused ones on their
shards (before int8 quantisation, which then covers the fused product); `declare` gives the fused
declarations, for shardings, AOT compiles and the divisibility check. The blocks call `qkv` and
`gate_up`, which take either form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.decoder import add_bias
from models.weights import Weight, shardings
from sharding.rules import Rules


def _fusable_attention(layer: dict) -> bool:
    return all(isinstance(layer.get(n), Weight) for n in ("wq", "wk", "wv"))


def _fusable_mlp(layer: dict) -> bool:
    return all(isinstance(layer.get(n), Weight) for n in ("w_gate", "w_up"))


def declare(decl: dict) -> dict:
    """The declaration with each layer's q/k/v and gate/up weights (and biases) fused."""
    layers = []
    for layer in decl["layers"]:
        layer = dict(layer)
        if _fusable_attention(layer):
            D, N, H = layer["wq"].shape
            K = layer["wk"].shape[1]
            bias = layer.pop("bq") is not None
            layer.pop("bk"), layer.pop("bv")
            del layer["wq"], layer["wk"], layer["wv"]
            layer["wqkv"] = Weight((D, K, N // K + 2, H), ("embed", "kv_heads", None, "head_dim"),
                                   contract=1)
            layer["bqkv"] = Weight((K, N // K + 2, H), ("kv_heads", None, "head_dim"),
                                   init="zeros") if bias else None
        if _fusable_mlp(layer):
            D, F = layer.pop("w_gate").shape
            del layer["w_up"]
            bias = layer.pop("b_gate") is not None
            layer.pop("b_up")
            layer["w_gate_up"] = Weight((D, 2, F), ("embed", None, "mlp"), contract=1)
            layer["b_gate_up"] = Weight((2, F), (None, "mlp"), init="zeros") if bias else None
        layers.append(layer)
    return dict(decl, layers=layers)


SEPARATE = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up", "b_gate", "b_up")


def _fuse_layer(w: dict) -> dict:
    """The fused weights from a layer's separate ones (those of SEPARATE it has)."""
    out = {}
    if "wq" in w:
        D, N, H = w["wq"].shape
        K = w["wk"].shape[1]
        out["wqkv"] = jnp.concatenate([w["wq"].reshape(D, K, N // K, H), w["wk"][:, :, None],
                                       w["wv"][:, :, None]], axis=2)
        out["bqkv"] = None if w.get("bq") is None else jnp.concatenate(
            [w["bq"].reshape(K, N // K, H), w["bk"][:, None], w["bv"][:, None]], axis=1)
    if "w_gate" in w:
        out["w_gate_up"] = jnp.stack([w["w_gate"], w["w_up"]], axis=1)
        out["b_gate_up"] = None if w.get("b_gate") is None else jnp.stack([w["b_gate"], w["b_up"]])
    return out


def fuse(decl: dict, params: dict, rules: Rules) -> dict:
    """Restored params (shaped like `decl`) with the fused weights, built on their shards. One
    layer at a time, its separate weights deleted once fused, every other weight left as it is:
    the fusion needs memory for one layer's projections, not a second copy of the model.
    `params` is consumed."""
    targets = shardings(declare(decl), rules)["layers"]
    layers = []
    for layer, target in zip(params["layers"], targets):
        separate = {n: x for n, x in layer.items() if n in SEPARATE}
        fused = {n: target[n] for n in ("wqkv", "bqkv", "w_gate_up", "b_gate_up")
                 if n in target and n not in layer}
        new = jax.jit(_fuse_layer, out_shardings=fused)(separate) if separate else {}
        for x in jax.tree.leaves(separate):
            x.delete()
        layers.append({**{n: x for n, x in layer.items() if n not in SEPARATE}, **new})
    return dict(params, layers=layers)


# --- the products -----------------------------------------------------------------------------

def qkv(p: dict, x: jax.Array, policy: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] -> q [B, T, N, H], k and v [B, T, K, H], biases added."""
    if "wqkv" not in p:
        return (add_bias(policy.einsum("BTD,DNH->BTNH", x, p["wq"]), p.get("bq")),
                add_bias(policy.einsum("BTD,DKH->BTKH", x, p["wk"]), p.get("bk")),
                add_bias(policy.einsum("BTD,DKH->BTKH", x, p["wv"]), p.get("bv")))
    y = add_bias(policy.einsum("BTD,DKJH->BTKJH", x, p["wqkv"]), p.get("bqkv"))
    B, T, K, J, H = y.shape
    return y[:, :, :, : J - 2].reshape(B, T, K * (J - 2), H), y[:, :, :, J - 2], y[:, :, :, J - 1]


def gate_up(p: dict, x: jax.Array, policy: Any) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> gate, up [B, T, F], biases added."""
    if "w_gate_up" not in p:
        return (add_bias(policy.einsum("BTD,DF->BTF", x, p["w_gate"]), p.get("b_gate")),
                add_bias(policy.einsum("BTD,DF->BTF", x, p["w_up"]), p.get("b_up")))
    y = add_bias(policy.einsum("BTD,DIF->BTIF", x, p["w_gate_up"]), p.get("b_gate_up"))
    return y[:, :, 0], y[:, :, 1]
