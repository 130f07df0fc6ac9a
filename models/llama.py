"""The Llama family: Llama 2/3, SmolLM2, Qwen2/Qwen2.5.

Reference: transformers' `LlamaForCausalLM` and `Qwen2ForCausalLM` (modeling_llama.py,
modeling_qwen2.py). A pre-norm decoder: RMSNorm, rotary attention with grouped-query K/V (optional
q/k/v bias for Qwen2), SwiGLU MLP, tied or untied unembedding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from models import fused, quant
from models.decoder import Unembedding, add_bias
from models.policy import Policy
from models.rope import Rope
from models.weights import Weight
from sharding.rules import Rules, constrain


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets this and out_bias
    out_bias: bool = False
    mlp_bias: bool = False

    @property
    def rope(self) -> Rope:
        return Rope(self.head_dim, self.rope_theta, self.rope_scaling)


PRESETS: dict[str, Config] = {
    "tiny": Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position=512),
    "smollm2-135m": Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                           max_position=8192, tie_embeddings=True),
    "smollm2-1.7b": Config(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_layers=24,
                           num_heads=32, num_kv_heads=32, head_dim=64, rope_theta=130000.0,
                           max_position=8192, tie_embeddings=True),
    "llama2-7b": Config(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                        num_heads=32, num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5),
    "llama3-8b": Config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position=8192),
    "llama3.1-8b": Config(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                          rope_theta=500000.0, max_position=131072,
                          rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                                        ("low_freq_factor", 1.0),
                                        ("original_max_position_embeddings", 8192),
                                        ("rope_type", "llama3"))),
    "qwen2.5-0.5b": Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                           num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                           rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=32768,
                           tie_embeddings=True, qkv_bias=True),
    "qwen2.5-7b": Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, max_position=32768,
                         qkv_bias=True),
}


def config_from_hf(hf: dict) -> Config:
    """From a transformers config.json (model_type llama or qwen2)."""
    heads = hf["num_attention_heads"]
    qwen = hf.get("model_type") == "qwen2"
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    bias = bool(hf.get("attention_bias", False))
    return Config(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=tuple(sorted(scaling.items())),
        max_position=hf.get("max_position_embeddings", 4096),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if qwen else bias,
        out_bias=False if qwen else bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


# --- weights ----------------------------------------------------------------------------------

def _bias(on: bool, shape: tuple, axes: tuple) -> Weight | None:
    return Weight(shape, axes, init="zeros") if on else None


def attention_weights(c: Any, qkv_bias: bool, out_bias: bool) -> dict:
    """A layer's attention weights and the norms before its two blocks, as Llama and GPT-OSS
    declare them (c: either family's Config)."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    return {
        "attn_norm": Weight((D,), ("embed",), init="ones"),
        "wq": Weight((D, N, H), ("embed", "heads", "head_dim"), contract=1),
        "wk": Weight((D, K, H), ("embed", "kv_heads", "head_dim"), contract=1),
        "wv": Weight((D, K, H), ("embed", "kv_heads", "head_dim"), contract=1),
        "bq": _bias(qkv_bias, (N, H), ("heads", "head_dim")),
        "bk": _bias(qkv_bias, (K, H), ("kv_heads", "head_dim")),
        "bv": _bias(qkv_bias, (K, H), ("kv_heads", "head_dim")),
        "wo": Weight((N, H, D), ("heads", "head_dim", "embed"), contract=2),
        "bo": _bias(out_bias, (D,), ("embed",)),
        "mlp_norm": Weight((D,), ("embed",), init="ones"),
    }


def declare(c: Config) -> dict:
    D, F, V = c.hidden_size, c.intermediate_size, c.vocab_size
    layer = {
        **attention_weights(c, c.qkv_bias, c.out_bias),
        "w_gate": Weight((D, F), ("embed", "mlp"), contract=1),
        "w_up": Weight((D, F), ("embed", "mlp"), contract=1),
        "w_down": Weight((F, D), ("mlp", "embed"), contract=1),
        "b_gate": _bias(c.mlp_bias, (F,), ("mlp",)),
        "b_up": _bias(c.mlp_bias, (F,), ("mlp",)),
        "b_down": _bias(c.mlp_bias, (D,), ("embed",)),
    }
    return {
        "embed": Weight((V, D), ("vocab", "embed"), contract=-1 if c.tie_embeddings else 0),  # [V, D]
        "layers": [dict(layer) for _ in range(c.num_layers)],
        "final_norm": Weight((D,), ("embed",), init="ones"),
        "unembed": None if c.tie_embeddings else Weight((D, V), ("embed", "vocab"), contract=1),  # [D, V]
    }


def cache_spec(c: Config) -> tuple[tuple[int | None, ...], int, int]:
    """(attention window per layer, None = full; kv heads; head_dim)."""
    return (None,) * c.num_layers, c.num_kv_heads, c.head_dim


# --- the decoder's pieces (models/decoder.py runs them) -----------------------------------------

def rope(c: Config) -> Rope:
    return c.rope


def embed(params: dict, tokens: jax.Array, positions: jax.Array, c: Config,
          policy: Policy) -> jax.Array:
    return quant.lookup(params["embed"], tokens).astype(policy.dtype)


def attn_norm(p: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return policy.rms_norm(x, p["attn_norm"], c.rms_norm_eps)


def qkv(p: dict, x: jax.Array, c: Config, policy: Policy) -> tuple[jax.Array, jax.Array, jax.Array]:
    return fused.qkv(p, x, policy)


def attention_options(p: dict, layer: int, c: Config) -> dict:
    return {}


def attention_out(p: dict, out: jax.Array, policy: Policy) -> jax.Array:
    return add_bias(policy.einsum("BTNH,NHD->BTD", out, p["wo"]), p["bo"])


def mlp_norm(p: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return policy.rms_norm(x, p["mlp_norm"], c.rms_norm_eps)


def mlp(p: dict, x: jax.Array, c: Config, rules: Rules, policy: Policy) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate, up = fused.gate_up(p, x, policy)  # [B, T, F] each
    h = constrain(jax.nn.silu(gate) * up, rules, "batch", "seq", "act_mlp")
    return add_bias(policy.einsum("BTF,FD->BTD", h, p["w_down"]), p["b_down"])


def final_norm(params: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return policy.rms_norm(x, params["final_norm"], c.rms_norm_eps)


def unembedding(params: dict) -> Unembedding:
    """Tied: the embedding [V, D] itself, never transposed; else the lm_head [D, V]."""
    tied = params["unembed"] is None
    return Unembedding(params["embed"] if tied else params["unembed"], vocab_first=tied)


# --- checkpoint names -------------------------------------------------------------------------

def attention_from_hf(t: dict[str, np.ndarray], i: int, c: Any, qkv_bias: bool, out_bias: bool
                      ) -> dict:
    """Layer i's `attention_weights` from transformers' names (torch Linear weights are [out,
    in]); a bias the config declares is read, and its absence is a missing tensor."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    a = f"model.layers.{i}.self_attn."
    return {
        "attn_norm": t[f"model.layers.{i}.input_layernorm.weight"],
        "wq": t[a + "q_proj.weight"].T.reshape(D, N, H),
        "wk": t[a + "k_proj.weight"].T.reshape(D, K, H),
        "wv": t[a + "v_proj.weight"].T.reshape(D, K, H),
        "bq": t[a + "q_proj.bias"].reshape(N, H) if qkv_bias else None,
        "bk": t[a + "k_proj.bias"].reshape(K, H) if qkv_bias else None,
        "bv": t[a + "v_proj.bias"].reshape(K, H) if qkv_bias else None,
        "wo": t[a + "o_proj.weight"].T.reshape(N, H, D),
        "bo": t[a + "o_proj.bias"] if out_bias else None,
        "mlp_norm": t[f"model.layers.{i}.post_attention_layernorm.weight"],
    }


def from_hf(tensors: dict[str, np.ndarray], c: Config) -> dict:
    """Maps transformers state-dict names to `declare`'s tree."""
    t = tensors
    layers = []
    for i in range(c.num_layers):
        m = f"model.layers.{i}.mlp."
        layers.append({
            **attention_from_hf(t, i, c, c.qkv_bias, c.out_bias),
            "w_gate": t[m + "gate_proj.weight"].T,
            "w_up": t[m + "up_proj.weight"].T,
            "w_down": t[m + "down_proj.weight"].T,
            "b_gate": t[m + "gate_proj.bias"] if c.mlp_bias else None,
            "b_up": t[m + "up_proj.bias"] if c.mlp_bias else None,
            "b_down": t[m + "down_proj.bias"] if c.mlp_bias else None,
        })
    return {
        "embed": t["model.embed_tokens.weight"],
        "layers": layers,
        "final_norm": t["model.norm.weight"],
        "unembed": None if c.tie_embeddings else t["lm_head.weight"].T,
    }
