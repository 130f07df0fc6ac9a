"""Weight-only int8 with one scale per output channel (precision.quantize="int8").

A projection W (declared with `contract`, see models/weights.py) is stored as
    q[*out, *contract] = round(W / scale) in [-127, 127],  scale[*out] = max |W| over contract / 127
with its output dimensions first, so each output channel is one contiguous row of bytes: the layout
the CPU kernel streams (models/kernels/cpu.py) and the one in which an embedding [V, D] is already
held, so a tied embedding is quantised once for both the lookup and the unembedding.

Activations, norms, biases and the KV cache stay in their own precision. On CPU the product runs in
the int8 kernel (in a shard_map over the rules' mesh, psum over a sharded contraction); elsewhere, or
with precision.kernels off, XLA's dot takes the int8 values converted and the scales multiply its
output (GPT-OSS's experts likewise, in models/gptoss.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from models import weights
from models.weights import Weight, is_weight
from sharding.rules import Rules


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    q: jax.Array  # int8 [*out, *contract]
    scale: jax.Array  # float32 [*out]
    out_axes: tuple[str | None, ...] = dataclasses.field(metadata={"static": True})
    contract_axes: tuple[str | None, ...] = dataclasses.field(metadata={"static": True})
    rules: Rules = dataclasses.field(metadata={"static": True})


def _split(w: Weight) -> tuple[list[int], list[int]]:
    """(output dims, contracted dims) of a projection's declaration, as indices into w.shape."""
    n, c = len(w.shape), w.contract
    contract = list(range(c)) if c > 0 else list(range(n + c, n))
    return [i for i in range(n) if i not in contract], contract


def quantizable(w: Any) -> bool:
    return is_weight(w) and w.contract != 0


def abstract(w: Weight, rules: Rules) -> QWeight:
    """The int8 form of one projection as ShapeDtypeStructs with their shardings."""
    out, contract = _split(w)
    q_axes = tuple(w.axes[i] for i in out + contract)
    s_axes = tuple(w.axes[i] for i in out)
    return QWeight(
        jax.ShapeDtypeStruct(tuple(w.shape[i] for i in out + contract), jnp.int8,
                             sharding=rules.sharding(*q_axes)),
        jax.ShapeDtypeStruct(tuple(w.shape[i] for i in out), jnp.float32,
                             sharding=rules.sharding(*s_axes)),
        s_axes, tuple(w.axes[i] for i in contract), rules)


def abstract_tree(decl: Any, rules: Rules, dtype: Any, quantize: str) -> Any:
    """What a restore (and `quantize`, when "int8") gives, as ShapeDtypeStructs with shardings."""
    restored = weights.abstract(decl, rules, dtype)
    if quantize != "int8":
        return restored
    return jax.tree.map(lambda w, a: abstract(w, rules) if quantizable(w) else a, decl, restored,
                        is_leaf=is_weight)


def stored_bytes(w: Weight, itemsize: int, quantize: str) -> int:
    """Bytes a weight takes as held: int8 plus its scales, or itemsize per element."""
    return nbytes(w) if quantize == "int8" and quantizable(w) else math.prod(w.shape) * itemsize


def nbytes(w: Weight) -> int:
    out, _ = _split(w)
    return math.prod(w.shape) + 4 * math.prod(w.shape[i] for i in out)


def quantize(decl: Any, params: Any, rules: Rules) -> Any:
    """params with every projection replaced by its QWeight, computed in place on its shards."""
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    flat = treedef.flatten_up_to(params)
    picked = [i for i, w in enumerate(leaves) if quantizable(w) and flat[i] is not None]
    targets = {i: abstract(leaves[i], rules) for i in picked}

    def one(w: Weight, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        out, contract = _split(w)
        x = jnp.transpose(x.astype(jnp.float32), out + contract)  # [*out, *contract]
        axes = tuple(range(len(out), x.ndim))
        scale = jnp.max(jnp.abs(x), axis=axes) / 127.0
        safe = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round(x / jnp.expand_dims(safe, axes)), -127, 127).astype(jnp.int8)
        return q, scale

    def all_of(xs):
        return [one(leaves[i], x) for i, x in zip(picked, xs)]

    shardings = [(targets[i].q.sharding, targets[i].scale.sharding) for i in picked]
    done = jax.jit(all_of, out_shardings=shardings)([flat[i] for i in picked])
    result = list(flat)
    for i, (q, scale) in zip(picked, done):
        t = targets[i]
        result[i] = QWeight(q, scale, t.out_axes, t.contract_axes, rules)
    return jax.tree.unflatten(treedef, result)


def spec_like(w: Any, spec: jax.sharding.PartitionSpec) -> Any:
    """A shard_map spec for w: `spec` for an array, or for a QWeight stored in its declared order
    (output dims first, the contracted ones last, as GPT-OSS's experts are declared) the spec of
    q and the same without its contracted dims for scale."""
    if not isinstance(w, QWeight):
        return spec
    n_out = w.scale.ndim
    return dataclasses.replace(w, q=spec, scale=jax.sharding.PartitionSpec(*spec[:n_out]))


def lookup(table: Any, tokens: jax.Array) -> jax.Array:
    """Rows of an embedding table [V, D] (float, or a QWeight quantised per row)."""
    if isinstance(table, QWeight):
        return table.q[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return table[tokens]


def matmul(x: jax.Array, w: QWeight, n_contract: int, precision: Any, kernels: bool
           ) -> jax.Array:
    """x [*free, *contract] . w -> [*free, *out], in float32 (x's dtype for the XLA path)."""
    free, out = x.shape[: x.ndim - n_contract], w.scale.shape
    C, O = math.prod(x.shape[x.ndim - n_contract:]), math.prod(out)
    from models.kernels import cpu

    if not (kernels and w.rules.platform == "cpu" and cpu.available()):
        # the int8 values enter the product converted (exact in bf16 and f32), which XLA folds into
        # the operand, and the per-output scales multiply the result: no dequantised weight is
        # written out
        q = w.q.astype(x.dtype).reshape(O, C)
        y = jax.lax.dot_general(x.reshape(*free, C), q, (((len(free),), (1,)), ((), ())),
                                precision=precision, preferred_element_type=jnp.float32)
        return (y * w.scale.reshape(O)).astype(x.dtype).reshape(*free, *out)
    rules = w.rules
    free_axes = ("batch", "seq")[: len(free)] if len(free) <= 2 else (None,) * len(free)
    x_spec = rules.spec(*free_axes, *w.contract_axes, shape=x.shape)
    q_spec = rules.spec(*w.out_axes, *w.contract_axes, shape=w.q.shape)
    s_spec = rules.spec(*w.out_axes, shape=w.scale.shape)
    reduce_axes = tuple(a for p in q_spec[len(out):] if p for a in ((p,) if isinstance(p, str) else p))
    y_spec = jax.sharding.PartitionSpec(*x_spec[: len(free)], *q_spec[: len(out)])

    def local(x, q, scale):
        lf, lo = x.shape[: len(free)], scale.shape
        y = cpu.matmul_nk_s8(x.reshape(math.prod(lf), -1), q.reshape(math.prod(lo), -1),
                             scale.reshape(-1))
        y = y.reshape(*lf, *lo)
        return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    if rules.mesh.size == 1:
        return local(x, w.q, w.scale).astype(x.dtype)
    y = jax.shard_map(local, mesh=rules.mesh, in_specs=(x_spec, q_spec, s_spec), out_specs=y_spec,
                      check_vma=False)(x, w.q, w.scale)
    return y.astype(x.dtype)
