"""Weight-only int8 with one scale per output channel (precision.quantize="int8"), or int4 in
groups of 32 along the contraction with a float16 scale and minimum each (precision.quantize="int4").

A projection W (declared with `contract`, see models/weights.py) is stored as
    q[*out, *contract] = round(W / scale) in [-127, 127],  scale[*out] = max |W| over contract / 127
with its output dimensions first, so each output channel is one contiguous row of bytes: the layout
the CPU kernel streams (models/kernels/cpu.py) and the one in which an embedding [V, D] is already
held, so a tied embedding is quantised once for both the lookup and the unembedding.

Activations, norms, biases and the KV cache stay in their own precision. On CPU the product runs in
the int8 kernel (in a shard_map over the rules' mesh, psum over a sharded contraction); elsewhere, or
with kernels.enabled off, XLA's dot takes the int8 values converted and the scales multiply its
output (GPT-OSS's experts likewise, in models/gptoss.py).

int4 (Q4Weight) holds [*out, C], the contracted dimensions flattened into C, in groups of
GROUP = 32 along C:
    u = round((W - m) / d) in [0, 15],  d = (max - min) / 15,  m = min over the group,
with d and m in float16, two u to a byte (byte i of a group: u[i] in the low nibble, u[i + 16] in
the high one): 0.625 bytes a weight, the numbers and bits of GGUF's Q4_1 blocks. A Q4_1 checkpoint
(SmolLM2's GGUF), dequantised by the converter, comes back to the same d, m and u. On CPU the CPU
kernel takes the nibbles; elsewhere the weight is unpacked and dequantised for XLA's dot, which on
TPU writes it out first (GPT-OSS-20B on v5e, AOT: 4.75 GB a step per chip against 3.84 in int8;
README), so there int4 saves memory, not traffic. The vocabulary's tables stay int8 under int4, as
GGUF's 4-bit files keep them in 6 or 8 bits: SmolLM2-135M's perplexity on tinyshakespeare (4096
tokens) rose 5.9% over float32 with its tied embedding in 4 bits. So do GPT-OSS's experts (their
products, models/gptoss.py, take per-channel scales).
"""

from __future__ import annotations

import dataclasses
import functools
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


GROUP = 32  # int4 weights a group, along the flattened contraction


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4Weight:
    q: jax.Array  # uint8 [*out, C / 2] (C: the contracted dims flattened), two 4-bit values a byte
    d: jax.Array  # float16 [*out, C / GROUP], each group's step
    m: jax.Array  # float16 [*out, C / GROUP], each group's minimum
    out_axes: tuple[str | None, ...] = dataclasses.field(metadata={"static": True})
    contract_axes: tuple[str | None, ...] = dataclasses.field(metadata={"static": True})
    rules: Rules = dataclasses.field(metadata={"static": True})


def projection_dims(w: Weight) -> tuple[list[int], list[int]]:
    """(output dims, contracted dims) of a projection's declaration, as indices into w.shape."""
    n, c = len(w.shape), w.contract
    contract = list(range(c)) if c > 0 else list(range(n + c, n))
    return [i for i in range(n) if i not in contract], contract


def quantizable(w: Any) -> bool:
    return is_weight(w) and w.contract != 0


def takes_int4(w: Weight) -> bool:
    """Whether precision.quantize="int4" holds w in 4 bits: every projection but the vocabulary's
    (the embedding and unembedding) and GPT-OSS's experts, which stay int8."""
    return quantizable(w) and "experts" not in w.axes and "vocab" not in w.axes


class QuantizeError(ValueError):
    """A weight cannot be held as precision.quantize asks."""


def _int4_layout(w: Weight, rules: Rules) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    """Shapes of q and of d, m for w, and their logical axes; a clear error where the groups of
    32 do not fit its shards."""
    out, contract = projection_dims(w)
    C = math.prod(w.shape[i] for i in contract)
    shards = [rules.shards(w.axes[i]) if rules.spec(w.axes[i], shape=(w.shape[i],))[0] else 1
              for i in contract]
    where = f"a weight of shape {w.shape} (axes {w.axes})"
    if any(n > 1 for n in shards[1:]):
        raise QuantizeError(f"precision.quantize=int4 cannot hold {where}: its contraction is "
                            f"sharded on an inner dimension; use int8 for this model or mesh")
    if C % (GROUP * shards[0]):
        raise QuantizeError(
            f"precision.quantize=int4 holds the contraction of a projection in groups of {GROUP}, "
            f"whole on every shard: {where} contracts {C} over {shards[0]} shard(s); use int8 "
            f"for this model or mesh")
    lead = tuple(w.shape[i] for i in out)
    axes = tuple(w.axes[i] for i in out) + (w.axes[contract[0]],)
    return lead + (C // 2,), lead + (C // GROUP,), axes


def abstract(w: Weight, rules: Rules) -> QWeight:
    """The int8 form of one projection as ShapeDtypeStructs with their shardings."""
    out, contract = projection_dims(w)
    q_axes = tuple(w.axes[i] for i in out + contract)
    s_axes = tuple(w.axes[i] for i in out)
    return QWeight(
        jax.ShapeDtypeStruct(tuple(w.shape[i] for i in out + contract), jnp.int8,
                             sharding=rules.sharding(*q_axes)),
        jax.ShapeDtypeStruct(tuple(w.shape[i] for i in out), jnp.float32,
                             sharding=rules.sharding(*s_axes)),
        s_axes, tuple(w.axes[i] for i in contract), rules)


def abstract4(w: Weight, rules: Rules) -> Q4Weight:
    """The int4 form of one projection as ShapeDtypeStructs with their shardings."""
    out, contract = projection_dims(w)
    q_shape, d_shape, axes = _int4_layout(w, rules)
    half = jnp.float16
    return Q4Weight(
        jax.ShapeDtypeStruct(q_shape, jnp.uint8, sharding=rules.sharding(*axes, shape=q_shape)),
        jax.ShapeDtypeStruct(d_shape, half, sharding=rules.sharding(*axes, shape=d_shape)),
        jax.ShapeDtypeStruct(d_shape, half, sharding=rules.sharding(*axes, shape=d_shape)),
        tuple(w.axes[i] for i in out), tuple(w.axes[i] for i in contract), rules)


def _target(w: Weight, rules: Rules, quantize: str) -> QWeight | Q4Weight | None:
    """What `quantize` makes of w, abstractly: None where w stays as restored."""
    if quantize == "int4" and takes_int4(w):
        return abstract4(w, rules)
    if quantize in ("int8", "int4") and quantizable(w):
        return abstract(w, rules)
    return None


def abstract_tree(decl: Any, rules: Rules, dtype: Any, quantize: str) -> Any:
    """What a restore (and `quantize`, when not "none") gives, as ShapeDtypeStructs with shardings."""
    restored = weights.abstract(decl, rules, dtype)
    if quantize == "none":
        return restored
    return jax.tree.map(lambda w, a: _target(w, rules, quantize) or a, decl, restored,
                        is_leaf=is_weight)


def stored_bytes(w: Weight, itemsize: int, quantize: str) -> int:
    """Bytes a weight takes as held: int8 plus its scales, int4 plus its groups' float16 scales
    and minima, or itemsize per element."""
    if quantize == "int4" and takes_int4(w):
        return math.prod(w.shape) // 2 + 4 * math.prod(w.shape) // GROUP
    return nbytes(w) if quantize in ("int8", "int4") and quantizable(w) else math.prod(w.shape) * itemsize


def nbytes(w: Weight) -> int:
    out, _ = projection_dims(w)
    return math.prod(w.shape) + 4 * math.prod(w.shape[i] for i in out)


def quantize_int4(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., C] (C a multiple of GROUP) -> q uint8 [..., C / 2], d, m float16 [..., C / GROUP]:
    each group's minimum and step (max - min) / 15, rounded to float16 before the values are
    rounded against them, so that d * u + m is what the products use."""
    x = x.astype(jnp.float32)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    lo, hi = jnp.min(g, axis=-1), jnp.max(g, axis=-1)
    # times the float32 nearest 1/15, which XLA computes as written (a division by 15 it may turn
    # into this product or not)
    d, m = ((hi - lo) * jnp.float32(1 / 15)).astype(jnp.float16), lo.astype(jnp.float16)
    d32, m32 = d.astype(jnp.float32)[..., None], m.astype(jnp.float32)[..., None]
    u = jnp.where(d32 > 0, jnp.round((g - m32) / jnp.where(d32 > 0, d32, 1.0)), 0.0)
    u = jnp.clip(u, 0, 15).astype(jnp.uint8)
    q = u[..., : GROUP // 2] | (u[..., GROUP // 2:] << 4)
    return q.reshape(*x.shape[:-1], x.shape[-1] // 2), d, m


def dequantize_int4(q: jax.Array, d: jax.Array, m: jax.Array, dtype: Any) -> jax.Array:
    """The weights [..., C] that q, d, m hold (quantize_int4's layout), in dtype."""
    b = q.reshape(*q.shape[:-1], d.shape[-1], GROUP // 2)
    u = jnp.concatenate([b & 15, b >> 4], axis=-1).astype(jnp.float32)
    w = u * d.astype(jnp.float32)[..., None] + m.astype(jnp.float32)[..., None]
    return w.reshape(*q.shape[:-1], q.shape[-1] * 2).astype(dtype)


def quantize(decl: Any, params: Any, rules: Rules, how: str = "int8") -> Any:
    """params with every projection replaced by its QWeight (or, `how` = "int4", Q4Weight),
    computed in place on its shards: one program per kind of projection (its declaration, form
    and shardings), called for each of them, so that a model's layers trace and compile it once
    (SmolLM2's 211 projections: 7 programs)."""
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    flat = treedef.flatten_up_to(params)
    result = list(flat)
    programs: dict[tuple, Any] = {}
    for i, (w, x) in enumerate(zip(leaves, flat)):
        if x is None or (t := _target(w, rules, how)) is None:
            continue
        int4 = isinstance(t, Q4Weight)
        shardings = tuple(a.sharding for a in ((t.q, t.d, t.m) if int4 else (t.q, t.scale)))
        key = (w, int4, shardings, x.dtype, x.sharding)
        if key not in programs:
            programs[key] = jax.jit(functools.partial(_quantized, w, int4), out_shardings=shardings)
        result[i] = (Q4Weight if int4 else QWeight)(*programs[key](x), t.out_axes, t.contract_axes,
                                                     rules)
    return jax.tree.unflatten(treedef, result)


def _quantized(w: Weight, int4: bool, x: jax.Array) -> tuple[jax.Array, ...]:
    """Projection w's values x in int4 (q, d, m) or int8 (q, scale), output dims first."""
    out, contract = projection_dims(w)
    x = jnp.transpose(x.astype(jnp.float32), out + contract)  # [*out, *contract]
    if int4:
        return quantize_int4(x.reshape(*x.shape[: len(out)], -1))
    axes = tuple(range(len(out), x.ndim))
    scale = jnp.max(jnp.abs(x), axis=axes) / 127.0
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / jnp.expand_dims(safe, axes)), -127, 127).astype(jnp.int8)
    return q, scale


def spec_like(w: Any, spec: jax.sharding.PartitionSpec) -> Any:
    """A shard_map spec for w: `spec` for an array, or for a QWeight stored in its declared order
    (output dims first, the contracted ones last, as GPT-OSS's experts are declared) the spec of
    q and the same without its contracted dims for scale."""
    if not isinstance(w, QWeight):
        return spec
    n_out = w.scale.ndim
    return dataclasses.replace(w, q=spec, scale=jax.sharding.PartitionSpec(*spec[:n_out]))


def lookup(table: Any, tokens: jax.Array) -> jax.Array:
    """Rows of an embedding table [V, D] (float, or a QWeight quantised per row: tables stay
    int8 under int4 too)."""
    if isinstance(table, QWeight):
        return table.q[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return table[tokens]


# Without batch invariance (Backend.any_rows), from these many rows of x on (a prefill's tokens),
# the CPU's product is XLA's dot of the weight dequantised to float32 once per call. The kernel
# dequantises in registers for every few rows, which pays while the weights' bytes bound the
# product (decode steps) and once arithmetic does costs more than XLA's dot; the dequantised copies cost a fixed time per call, which small
# prefills (a prompt or two) do not win back. Not for int4 products in bfloat16
# (Backend.int4_bf16_rows), which run at twice float32's multiply-adds and beat XLA's dot at any
# row count.
XLA_ROWS_INT4, XLA_ROWS_INT8 = 1024, 1024


def _dequantized_dot(x: jax.Array, q: jax.Array, *scales: jax.Array) -> jax.Array:
    """x [M, C] . w^T, w [N, C] held as int8 (scales: [N, 1]) or int4 (scales: d, m), in float32.
    The barrier keeps the dequantised weight a buffer of its own: folded into the dot's operand,
    the conversion sends XLA:CPU to a slow loop."""
    if len(scales) == 2:
        w = dequantize_int4(q, *scales, jnp.float32)
    else:
        w = q.astype(jnp.float32) * scales[0]
    w = jax.lax.optimization_barrier(w)
    return jax.lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                               precision=jax.lax.Precision.HIGHEST)


def matmul(x: jax.Array, w: QWeight | Q4Weight, n_contract: int, precision: Any, backend: Any
           ) -> jax.Array:
    """x [*free, *contract] . w -> [*free, *out], in float32 (x's dtype for the XLA path): in
    the backend's kernel (Backend.int_matmul) where it has one, else XLA's dot."""
    free, out = x.shape[: x.ndim - n_contract], tuple(w.q.shape[: len(w.out_axes)])
    C, O = math.prod(x.shape[x.ndim - n_contract:]), math.prod(out)
    int4 = isinstance(w, Q4Weight)
    kernel = backend.int_matmul(int4)
    if kernel is None:
        if int4:  # dequantised for the dot (XLA has no product over packed nibbles)
            q = dequantize_int4(w.q, w.d, w.m, x.dtype).reshape(O, C)
            return jax.lax.dot_general(x.reshape(*free, C), q, (((len(free),), (1,)), ((), ())),
                                       precision=precision).reshape(*free, *out)
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
    q_axes = (*w.out_axes, *w.contract_axes[: 1 if int4 else None])  # int4: C flattened
    q_spec = rules.spec(*q_axes, shape=w.q.shape)
    reduce_axes = tuple(a for p in q_spec[len(out):] if p for a in ((p,) if isinstance(p, str) else p))
    y_spec = jax.sharding.PartitionSpec(*x_spec[: len(free)], *q_spec[: len(out)])
    if int4:
        s_spec = rules.spec(*q_axes, shape=w.d.shape)
        scales, s_specs = (w.d, w.m), (s_spec, s_spec)
    else:
        scales, s_specs = (w.scale,), (rules.spec(*w.out_axes, shape=w.scale.shape),)

    def local(x, q, *scales):
        lf, lo = x.shape[: len(free)], q.shape[: len(out)]
        rows, n = math.prod(lf), math.prod(lo)
        x2 = x.reshape(rows, -1)
        if rows >= (XLA_ROWS_INT4 if int4 else XLA_ROWS_INT8) and not backend.any_rows \
                and not (int4 and backend.int4_bf16_rows):
            y = _dequantized_dot(x2, q.reshape(n, -1), *(s.reshape(n, -1) for s in scales))
        elif int4:
            y = kernel(x2, q.reshape(n, -1), *(s.reshape(n, -1) for s in scales))
        else:
            y = kernel(x2, q.reshape(n, -1), scales[0].reshape(-1))
        y = y.reshape(*lf, *lo)
        return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    if rules.mesh.size == 1:
        return local(x, w.q, *scales).astype(x.dtype)
    y = jax.shard_map(local, mesh=rules.mesh, in_specs=(x_spec, q_spec, *s_specs),
                      out_specs=y_spec, check_vma=False)(x, w.q, *scales)
    return y.astype(x.dtype)
