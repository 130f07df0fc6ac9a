"""GPT-OSS-20B/120B.

References: OpenAI's `gpt_oss/torch/model.py` (openai/gpt-oss) and transformers'
`GptOssForCausalLM` (modeling_gpt_oss.py). A pre-norm decoder: RMSNorm; attention with q/k/v/o
biases, YaRN RoPE, one learned sink logit per query head, and a sliding window on the layers the
config marks; a mixture of experts (router with bias, top-k, softmax over the chosen logits) whose
experts are clamped SwiGLU MLPs: gate * sigmoid(alpha * gate) * (up + 1); untied unembedding.

MoE letters: M tokens (B*T), A assignments (M*k), E experts (local to a shard inside shard_map),
C capacity (rows per expert), I the gate/up pair.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from models import llama, quant
from models.decoder import Unembedding
from models.policy import Policy
from models.rope import Rope
from models.weights import Weight
from sharding.rules import Rules, constrain

# Logical axes of the expert weights; `declare` and the MoE's shard_map specs both use them.
# The contracted dimension is last: held [E, D, 2, F], XLA:TPU re-laid out every layer's experts
# (66 MB per chip for 20b) on every decode step to put D minor for the MXU.
EXPERT_AXES = {
    "w_gate_up": ("experts", None, "mlp", "embed"),  # [E, 2, F, D]; [:, 0] is the gate
    "b_gate_up": ("experts", None, "mlp"),  # [E, 2, F]
    "w_down": ("experts", "embed", "mlp"),  # [E, D, F]
    "b_down": ("experts", "embed"),  # [E, D]
}
# The down projection as the experts kernel reads it (Backend.experts_kernel): [E, F, D], so that
# a chunk of F is a block of whole rows. `for_backend` makes it from the declared w_down.
DOWN_ROWS = ("experts", "mlp", "embed")
YARN = (("beta_fast", 32.0), ("beta_slow", 1.0), ("factor", 32.0),
        ("original_max_position_embeddings", 4096), ("rope_type", "yarn"), ("truncate", False))


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 201088
    hidden_size: int = 2880  # D
    intermediate_size: int = 2880  # F, per expert
    num_layers: int = 24
    num_heads: int = 64  # N
    num_kv_heads: int = 8  # K
    head_dim: int = 64  # H
    num_experts: int = 32  # E
    experts_per_token: int = 4  # k
    sliding_window: int = 128
    sliding_layers: tuple[bool, ...] = ()  # per layer; () = the even layers, as released
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: tuple[tuple[str, Any], ...] = YARN
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    max_position: int = 131072
    capacity_factor: float = 2.0  # expert capacity, as a multiple of the mean load, tried first

    @property
    def rope(self) -> Rope:
        return Rope(self.head_dim, self.rope_theta, self.rope_scaling)

    def window(self, layer: int) -> int | None:
        sliding = self.sliding_layers[layer] if self.sliding_layers else layer % 2 == 0
        return self.sliding_window if sliding else None


PRESETS: dict[str, Config] = {
    "20b": Config(),
    "120b": Config(num_layers=36, num_experts=128),
    "tiny": Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=8,
                   num_kv_heads=4, head_dim=16, num_experts=8, experts_per_token=2,
                   sliding_window=8, max_position=4096),
    # the o200k_harmony vocabulary around a tiny body: runs end to end with real Harmony text
    "tiny-o200k": Config(hidden_size=64, intermediate_size=64, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=16, num_experts=8, experts_per_token=4,
                         sliding_window=16, max_position=4096),
}


def config_from_hf(hf: dict) -> Config:
    scaling = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta") or scaling.pop("rope_theta", 150000.0)
    scaling.pop("rope_theta", None)
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(layers)]
    return Config(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_experts=hf["num_local_experts"],
        experts_per_token=hf.get("num_experts_per_tok") or hf["experts_per_token"],
        sliding_window=hf.get("sliding_window") or 128,
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())) if scaling else YARN,
        swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        swiglu_limit=hf.get("swiglu_limit", 7.0),
        max_position=hf.get("max_position_embeddings", 131072),
    )


# --- weights ----------------------------------------------------------------------------------

def declare(c: Config) -> dict:
    D, F, N, E, V = c.hidden_size, c.intermediate_size, c.num_heads, c.num_experts, c.vocab_size
    layer = {
        **llama.attention_weights(c, qkv_bias=True, out_bias=True),
        "sinks": Weight((N,), ("heads",), init="zeros"),  # one logit per query head
        "router_w": Weight((D, E), ("embed", None)),  # every shard routes every token
        "router_b": Weight((E,), (None,), init="zeros"),
        # contract=-1: int8 quantisation (precision.quantize) keeps one scale per expert and
        # output channel, over the contracted (last) dimension
        "w_gate_up": Weight((E, 2, F, D), EXPERT_AXES["w_gate_up"], contract=-1),
        "b_gate_up": Weight((E, 2, F), EXPERT_AXES["b_gate_up"], init="zeros"),
        "w_down": Weight((E, D, F), EXPERT_AXES["w_down"], contract=-1),
        "b_down": Weight((E, D), EXPERT_AXES["b_down"], init="zeros"),
    }
    return {
        "embed": Weight((V, D), ("vocab", "embed")),  # [V, D]
        "layers": [dict(layer) for _ in range(c.num_layers)],
        "final_norm": Weight((D,), ("embed",), init="ones"),
        "unembed": Weight((V, D), ("vocab", "embed"), contract=-1),  # [V, D], as lm_head
    }


def cache_spec(c: Config) -> tuple[tuple[int | None, ...], int, int]:
    return tuple(c.window(i) for i in range(c.num_layers)), c.num_kv_heads, c.head_dim


# --- mixture of experts -----------------------------------------------------------------------

def swiglu(gate_up: jax.Array, c: Config) -> jax.Array:
    """gate_up [..., 2F] (gate, then up) -> [..., F]: the clamped SwiGLU of the reference, with up
    shifted by one. Kept flat as the product gives it: on TPU, splitting an F that is no multiple
    of 128 into its own axis (GPT-OSS's 1440 per shard) copies the whole activation."""
    F = gate_up.shape[-1] // 2
    gate = jnp.minimum(gate_up[..., :F], c.swiglu_limit)
    up = jnp.clip(gate_up[..., F:], -c.swiglu_limit, c.swiglu_limit)
    return gate * jax.nn.sigmoid(c.swiglu_alpha * gate) * (up + 1)


def _flat(a: jax.Array, y: jax.Array) -> jax.Array:
    """A per-output [..., 2, F] (gate/up) or [..., D] array in y's flat layout [..., 2F] or [..., D]."""
    return a.reshape(*a.shape[: y.ndim - 1], -1)


def _converted(w: dict, dtype) -> dict:
    """int8 experts enter their products converted where the products are, inside whichever
    branch runs them: XLA folds the conversion into the product's operand there, while a
    conversion outside a conditional is a whole dequantised copy of the experts every step."""
    return {n: a.astype(dtype) for n, a in w.items()}


def _scaled(y, scales, name, index):
    """int8 experts: their per-expert, per-output scales applied to the product's output."""
    return y if name not in scales else y * _flat(scales[name][index], y).astype(y.dtype)


def _experts_gathered(x, expert, weight, w, scales, c, policy):
    """Few assignments (decode): gather each assignment's expert weights. x [M, D]; expert,
    weight [M, k] (weight 0 where the expert lives on another shard)."""
    w = _converted(w, x.dtype)
    wg = w["w_gate_up"][expert]  # [M, k, 2, F, D]
    gate_up = policy.einsum("MD,MKGD->MKG", x, wg.reshape(*wg.shape[:2], -1, wg.shape[-1]))
    gate_up = _scaled(gate_up, scales, "w_gate_up", expert)  # [M, k, 2F]
    gate_up = gate_up + _flat(w["b_gate_up"][expert], gate_up)
    if "w_down_rows" in w:
        y = policy.einsum("MKF,MKFD->MKD", swiglu(gate_up, c), w["w_down_rows"][expert])
    else:
        y = policy.einsum("MKF,MKDF->MKD", swiglu(gate_up, c), w["w_down"][expert])
    y = _scaled(y, scales, "w_down", expert) + w["b_down"][expert]
    return jnp.einsum("MKD,MK->MD", y, weight.astype(y.dtype))


def _by_expert(expert):
    """Assignments [M, k] in expert order: (flat experts [A], the order, the sorted experts, each
    sorted assignment's token)."""
    flat_e = expert.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    return flat_e, order, flat_e[order], order // expert.shape[1]


ONE_HOT_DISPATCH = 1 << 21  # largest M * E * C routed by one-hot products


def _experts_grouped(x, expert, weight, w, scales, c, policy, capacity):
    """Many assignments (decode of a large batch, prefill): group them by expert into [E, C]
    buckets and run one batched matmul per projection. Assignments beyond an expert's capacity go to a dropped slot; callers
    choose `capacity` so that none does."""
    M, D = x.shape
    w = _converted(w, x.dtype)
    E = w["w_down"].shape[0]
    flat_e, order, sorted_e, token = _by_expert(expert)
    counts = jnp.bincount(flat_e, length=E + 1)  # E = "not on this shard"
    rank = jnp.arange(flat_e.shape[0]) - (jnp.cumsum(counts) - counts)[sorted_e]
    slot = jnp.where((sorted_e < E) & (rank < capacity), sorted_e * capacity + rank, E * capacity)
    # A few tokens (decode, short prefills) move into and out of the buckets as one-hot products:
    # a gather or scatter of single rows reads whole (16, 128) tiles of a bf16 array on TPU, by
    # XLA's cost analysis many times the bytes moved. The products' flops grow with M * E * C;
    # up to ONE_HOT_DISPATCH they still cost less HBM time than the gathers, the flops under it.
    one_hot = M * E * capacity <= ONE_HOT_DISPATCH
    if one_hot:
        route = (slot[:, None] == jnp.arange(E * capacity)).astype(x.dtype)  # [A, E*C]
        dispatch = jnp.einsum("AS,AM->SM", route, jax.nn.one_hot(token, M, dtype=x.dtype))
        rows = jnp.einsum("SM,MD->SD", dispatch, x, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=x.dtype)  # exact: one 1 per row at most
        rows = rows.reshape(E, capacity, D)
    else:
        rows = jnp.zeros((E * capacity + 1, D), x.dtype).at[slot].set(x[token])
        rows = rows[:-1].reshape(E, capacity, D)
    wg = w["w_gate_up"]  # [E, 2, F, D], one [E, 2F, D] product (a separate 2 axis made XLA:TPU
    # lay the weights out again on every step)
    gate_up = policy.einsum("ECD,EGD->ECG", rows, wg.reshape(E, -1, D))
    experts = (slice(None), None)  # [E, 1, ...]: each bucket's expert
    gate_up = _scaled(gate_up, scales, "w_gate_up", experts)  # [E, C, 2F]
    gate_up = gate_up + _flat(w["b_gate_up"][:, None], gate_up)
    y = policy.einsum("ECF,EDF->ECD", swiglu(gate_up, c), w["w_down"])
    y = _scaled(y, scales, "w_down", experts) + w["b_down"][:, None]
    if one_hot:  # out[m] = sum over m's assignments of weight * y[slot]
        weighted = route * weight.reshape(-1)[order][:, None].astype(route.dtype)  # [A, E*C]
        combine = jnp.einsum("AS,AM->MS", weighted, jax.nn.one_hot(token, M, dtype=y.dtype))
        # each token's k terms summed in float32 inside the product, written once in y's dtype
        return jnp.einsum("MS,SD->MD", combine, y.reshape(E * capacity, D), precision=policy.precision,
                          preferred_element_type=y.dtype)
    y = jnp.concatenate([y.reshape(E * capacity, D), jnp.zeros((1, D), y.dtype)])[slot]
    y = y * weight.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((M, D), y.dtype).at[token].add(y)


def _experts_dense(x, expert, weight, w, scales, c, policy):
    """Every local expert on every token: what grouping with a capacity of M rows per expert
    computes, without moving tokens into buckets and back. The fallback when an expert's load
    may reach M (the bound of the conditional below); on TPU its step reads and writes [E, M, *]
    twice where the buckets did four times, plus the dispatch. x [M, D]; expert, weight [M, k],
    expert = E where the expert lives on another shard."""
    M, D = x.shape
    w = _converted(w, x.dtype)
    E = w["w_down"].shape[0]
    experts = (slice(None), None)  # [E, 1, ...]
    gate_up = policy.einsum("MD,EGD->EMG", x, w["w_gate_up"].reshape(E, -1, D))
    gate_up = _scaled(gate_up, scales, "w_gate_up", experts) + _flat(w["b_gate_up"][:, None], gate_up)
    y = policy.einsum("EMF,EDF->EMD", swiglu(gate_up, c), w["w_down"])
    y = _scaled(y, scales, "w_down", experts) + w["b_down"][:, None]
    share = jnp.einsum("MK,MKE->ME", weight, jax.nn.one_hot(expert, E, dtype=weight.dtype))
    return jnp.einsum("EMD,ME->MD", y, share.astype(y.dtype), precision=policy.precision,
                      preferred_element_type=jnp.float32).astype(y.dtype)


def experts_ragged(x, expert, weight, w, scales, c, gmm):
    """Many assignments on TPU (kernels.pallas_moe): sorted by expert, each expert's rows one
    ragged group of the backend's grouped matmul `gmm` (Backend.grouped_matmul: JAX's megablox
    gmm), so no assignment waits in a bucket padded to a capacity. x [M, D]; expert, weight
    [M, k], expert = E where the expert lives on another shard (those rows are sorted last, left
    out of every group, and zeroed)."""
    M, D = x.shape
    w = _converted(w, x.dtype)
    E = w["w_down"].shape[0]
    flat_e, order, sorted_e, token = _by_expert(expert)
    A = flat_e.shape[0]
    padded = -(-A // 128) * 128  # gmm's row tiles
    sizes = jnp.bincount(flat_e, length=E + 1)[:E].astype(jnp.int32)
    e = jnp.minimum(sorted_e, E - 1)  # each row's expert (any, for another shard's rows)
    mine = (sorted_e < E)[:, None]

    def product(rows, weights):  # rows [A, K], weights [E, N, K] -> [A, N]
        rows = jnp.zeros((padded, rows.shape[1]), rows.dtype).at[:A].set(rows)
        out = gmm(rows, weights, sizes, preferred_element_type=jnp.float32, transpose_rhs=True)
        return jnp.where(mine, out[:A], 0.0)  # rows outside every group are never written

    wg = w["w_gate_up"]  # [E, 2, F, D]
    gate_up = product(x[token], wg.reshape(E, -1, D)).astype(x.dtype)  # [A, 2F]
    gate_up = _scaled(gate_up, scales, "w_gate_up", e) + _flat(w["b_gate_up"][e], gate_up)
    y = product(swiglu(gate_up, c), w["w_down"]).astype(x.dtype)  # w_down [E, D, F]
    y = _scaled(y, scales, "w_down", e) + w["b_down"][e]
    y = jnp.where(mine, y, 0) * weight.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((M, D), y.dtype).at[token].add(y)


def _experts_fused(x, norm, expert, weight, w, c, capacity, kernel):
    """A decode step's tokens through the backend's experts kernel (`kernel`: Backend.experts),
    which normalises them, reads each local expert's weights once and writes only the tokens'
    outputs: the tokens in [E, C] buckets, or, when an expert's load passes the capacity, every
    local expert on every token. x [M, D] before the MoE's RMSNorm (weight `norm`); expert,
    weight [M, k], expert = E where the expert lives on another shard."""
    M = x.shape[0]
    E = w["w_down_rows"].shape[0]
    run = partial(kernel, x.T, norm, w_gate_up=w["w_gate_up"], b_gate_up=w["b_gate_up"],
                  w_down_t=w["w_down_rows"], b_down=w["b_down"], eps=c.rms_norm_eps,
                  limit=c.swiglu_limit, alpha=c.swiglu_alpha)
    chosen = expert[:, :, None] == jnp.arange(E)  # [M, k, E]
    taken = jnp.any(chosen, axis=1)  # [M, E]: the token goes to the expert
    share = jnp.sum(jnp.where(chosen, weight[:, :, None], 0), axis=1).T  # [E, M]

    def grouped():  # a token's slot in an expert's bucket: the tokens before it taken there
        slot = jnp.where(taken, jnp.cumsum(taken, axis=0) - taken, capacity).T  # [E, M]
        return run(slot, share, capacity=capacity).T

    def dense():  # every token in every bucket, in its own slot
        return run(jnp.broadcast_to(jnp.arange(M), (E, M)), share, capacity=M).T

    load = jnp.max(jnp.sum(taken, axis=0))
    return dense() if capacity >= M else jax.lax.cond(load <= capacity, grouped, dense)


def _moe_shard(x, normed, expert, weight, w, norm, *, c: Config, policy: Policy, expert_axes,
               model_axes, gmm: Callable | None = None):
    """One device's share: its tokens [B, T, D], before the MoE's RMSNorm (x; its weight `norm`,
    for the experts kernel, which normalises them itself) and after (normed), through its experts
    and its slice of F. int8 experts (QWeight, stored as declared: [*out, D]
    and [*out, F]) enter the products as converted int8, which XLA folds into the products'
    operands, and their scales multiply the outputs; a dequantised copy of the experts would be
    written and read again on every step."""
    scales = {n: a.scale for n, a in w.items() if isinstance(a, quant.QWeight)}
    w = {n: a.q if isinstance(a, quant.QWeight) else a for n, a in w.items()}  # int8 stays int8 here
    B, T, D = x.shape
    E = w["b_down"].shape[0]  # local experts
    first = jax.lax.axis_index(expert_axes) * E if expert_axes else 0
    local = expert - first
    mine = (local >= 0) & (local < E)
    weight = jnp.where(mine, weight, 0)
    if model_axes:  # the down projection's bias once, not once per slice of F
        w = dict(w, b_down=jnp.where(jax.lax.axis_index(model_axes) == 0, w["b_down"], 0))
    kernel = None
    if "w_down_rows" in w:  # held for the backend's experts kernel
        kernel = policy.backend.experts(B * T, D, w["w_down_rows"].shape[1], x.dtype)
        if 4 * local.size <= E:  # the gathered path below takes each assignment's rows
            kernel = None
        elif kernel is None:  # XLA folds the transpose into its products
            w = dict(w, w_down=jnp.swapaxes(w.pop("w_down_rows"), 1, 2))
    x = (x if kernel is not None else normed).reshape(B * T, D)
    local, mine, weight = (a.reshape(B * T, -1) for a in (local, mine, weight))
    elsewhere = jnp.where(mine, local, E)  # E: the expert lives on another shard
    # the mean load of an expert: the assignments over all experts, not this shard's E
    small = min(B * T, max(1, math.ceil(c.capacity_factor * local.size / c.num_experts)))
    # Gathering weights per assignment wins only while the assignments touch a small share of
    # the experts; past that, grouping with a 2x-mean-load capacity beats running every expert
    # densely and jax.lax.ragged_dot (docs/benchmarks/ has the measurements), and the experts
    # kernel beats grouping in XLA where it runs.
    if 4 * local.size <= E:
        y = _experts_gathered(x, jnp.where(mine, local, 0), weight, w, scales, c, policy)
    elif kernel is not None:
        y = _experts_fused(x, norm, elsewhere, weight, w, c, small, kernel)
    elif gmm is not None:
        y = experts_ragged(x, elsewhere, weight, w, scales, c, gmm)
    else:
        counts = jnp.bincount(elsewhere.reshape(-1), length=E + 1)[:E]
        dense = partial(_experts_dense, x, elsewhere, weight, w, scales, c, policy)
        grouped = partial(_experts_grouped, x, elsewhere, weight, w, scales, c, policy, small)
        # exact either way: the small buckets when they hold every assignment
        y = dense() if small >= B * T else jax.lax.cond(jnp.max(counts) <= small, grouped, dense)
    axes = tuple(expert_axes) + tuple(model_axes)
    if axes:
        y = jax.lax.psum(y, axes)
    return y.reshape(B, T, D)


def moe_block(p: dict, x: jax.Array, c: Config, rules: Rules, policy: Policy) -> jax.Array:
    """The mixture of experts on the residual stream x, its RMSNorm included."""
    with jax.named_scope("moe"):
        normed = policy.rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
        logits = policy.einsum("BTD,DE->BTE", normed, p["router_w"]) + p["router_b"]
        top, expert = jax.lax.top_k(logits, c.experts_per_token)  # [B, T, k]
        weight = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype)
        held = dict(EXPERT_AXES, w_down_rows=DOWN_ROWS)
        w = {n: p[n] for n in held if n in p}
        # inside, every device holds whole rows of D (an FSDP-sharded embed is gathered on entry)
        specs = {n: quant.spec_like(w[n], rules.spec(*(None if a == "embed" else a for a in held[n])))
                 for n in w}
        act = rules.spec("batch", "seq", "act_embed", shape=x.shape)
        route = rules.spec("batch", "seq", None, shape=expert.shape)
        expert_axes = tuple(a for a in rules.axes("experts") if rules.mesh.shape[a] > 1)
        model_axes = tuple(a for a in rules.axes("mlp") if rules.mesh.shape[a] > 1)
        fn = partial(_moe_shard, c=c, policy=policy, expert_axes=expert_axes, model_axes=model_axes,
                     gmm=policy.backend.grouped_matmul())
        y = jax.shard_map(
            fn, mesh=rules.mesh, check_vma=False,
            in_specs=(act, act, route, route, specs, rules.spec(None)),
            out_specs=act,
        )(x, normed, expert, weight, w, p["mlp_norm"])
        return constrain(y, rules, "batch", "seq", "act_embed")


def for_backend(params: dict, rules: Rules, backend) -> dict:
    """Restored weights (or their ShapeDtypeStructs) as the backend runs them: where its experts
    kernel runs (Backend.experts_kernel), each layer's w_down [E, D, F] held as w_down_rows
    [E, F, D], sharded as declared. `params` is consumed."""
    if not backend.experts_kernel:
        return params
    sharding = rules.sharding(*DOWN_ROWS)
    swap = jax.jit(lambda w: jnp.swapaxes(w, 1, 2), out_shardings=sharding, donate_argnums=0)

    def rows(w):
        if isinstance(w, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((w.shape[0], w.shape[2], w.shape[1]), w.dtype, sharding=sharding)
        return swap(w)

    layers = [{("w_down_rows" if n == "w_down" else n): rows(a) if n == "w_down" else a
               for n, a in layer.items()} for layer in params["layers"]]
    return dict(params, layers=layers)


# --- the decoder's pieces (models/decoder.py runs them) -----------------------------------------

# As Llama's: the token embedding, RMSNorms, rotary q/k/v and the output projection with biases.
rope, embed, attn_norm, qkv = llama.rope, llama.embed, llama.attn_norm, llama.qkv
attention_out, final_norm = llama.attention_out, llama.final_norm


def mlp_norm(p: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    """The residual stream as it is: moe_block applies the RMSNorm itself, its TPU kernel to the
    tokens it reads (a normalised copy would be written and read again each layer)."""
    return x


def attention_options(p: dict, layer: int, c: Config) -> dict:
    """The layer's window (scanned: its place in the period, as the windows repeat) and sinks."""
    return {"window": c.window(layer), "sinks": p["sinks"]}


def mlp(p: dict, x: jax.Array, c: Config, rules: Rules, policy: Policy) -> jax.Array:
    return moe_block(p, x, c, rules, policy)


def unembedding(params: dict) -> Unembedding:
    """The lm_head [V, D] as transformers stores it."""
    return Unembedding(params["unembed"], vocab_first=True)


# --- checkpoint names -------------------------------------------------------------------------

def from_hf(tensors: dict[str, np.ndarray], c: Config) -> dict:
    """transformers' names; its fused experts.gate_up_proj [E, D, 2F] interleaves gate (even
    columns) and up (odd columns)."""
    D, F, E = c.hidden_size, c.intermediate_size, c.num_experts
    t = tensors
    layers = []
    for i in range(c.num_layers):
        m = f"model.layers.{i}.mlp."
        layers.append({
            **llama.attention_from_hf(t, i, c, qkv_bias=True, out_bias=True),
            "sinks": t[f"model.layers.{i}.self_attn.sinks"],
            "router_w": t[m + "router.weight"].T, "router_b": t[m + "router.bias"],
            "w_gate_up": t[m + "experts.gate_up_proj"].reshape(E, D, F, 2).transpose(0, 3, 2, 1),
            "b_gate_up": t[m + "experts.gate_up_proj_bias"].reshape(E, F, 2).transpose(0, 2, 1),
            "w_down": t[m + "experts.down_proj"].transpose(0, 2, 1),
            "b_down": t[m + "experts.down_proj_bias"],
        })
    return {"embed": t["model.embed_tokens.weight"], "layers": layers,
            "final_norm": t["model.norm.weight"], "unembed": t["lm_head.weight"]}
