"""GPT-2.

Reference: transformers' `GPT2LMHeadModel` (modeling_gpt2.py). Learned absolute positions,
pre-norm LayerNorm blocks, one fused q/k/v projection with bias, tanh-approximated GELU MLP, and
the token embedding reused as the unembedding.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from models import llama, quant
from models.decoder import Unembedding
from models.norms import layer_norm
from models.policy import Policy
from models.weights import Weight
from sharding.rules import Rules, constrain


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 50257
    hidden_size: int = 768  # D
    num_layers: int = 12
    num_heads: int = 12  # N
    max_position: int = 1024
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:  # H
        return self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:  # F
        return 4 * self.hidden_size


PRESETS: dict[str, Config] = {
    "tiny": Config(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, max_position=256),
    "gpt2": Config(),
    "gpt2-medium": Config(hidden_size=1024, num_layers=24, num_heads=16),
    "gpt2-large": Config(hidden_size=1280, num_layers=36, num_heads=20),
    "gpt2-xl": Config(hidden_size=1600, num_layers=48, num_heads=25),
}


def config_from_hf(hf: dict) -> Config:
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        raise ValueError(f"GPT-2 config n_inner={hf['n_inner']} is not 4*n_embd; not supported")
    return Config(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["n_embd"],
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        max_position=hf["n_positions"],
        layer_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
    )


def declare(c: Config) -> dict:
    D, F, N, H, V = c.hidden_size, c.intermediate_size, c.num_heads, c.head_dim, c.vocab_size
    layer = {
        "ln1_w": Weight((D,), ("embed",), init="ones"),
        "ln1_b": Weight((D,), ("embed",), init="zeros"),
        "wqkv": Weight((D, 3, N, H), ("embed", None, "heads", "head_dim"), contract=1),
        "bqkv": Weight((3, N, H), (None, "heads", "head_dim"), init="zeros"),
        "wo": Weight((N, H, D), ("heads", "head_dim", "embed"), contract=2),
        "bo": Weight((D,), ("embed",), init="zeros"),
        "ln2_w": Weight((D,), ("embed",), init="ones"),
        "ln2_b": Weight((D,), ("embed",), init="zeros"),
        "w_fc": Weight((D, F), ("embed", "mlp"), contract=1),
        "b_fc": Weight((F,), ("mlp",), init="zeros"),
        "w_proj": Weight((F, D), ("mlp", "embed"), contract=1),
        "b_proj": Weight((D,), ("embed",), init="zeros"),
    }
    return {
        "wte": Weight((V, D), ("vocab", "embed"), contract=-1),  # [V, D], also the unembedding
        "wpe": Weight((c.max_position, D), (None, "embed"), scale=0.01),  # [max_position, D]
        "layers": [dict(layer) for _ in range(c.num_layers)],
        "lnf_w": Weight((D,), ("embed",), init="ones"),
        "lnf_b": Weight((D,), ("embed",), init="zeros"),
    }


def cache_spec(c: Config) -> tuple[tuple[int | None, ...], int, int]:
    return (None,) * c.num_layers, c.num_heads, c.head_dim


# --- the decoder's pieces (models/decoder.py runs them) -----------------------------------------

# As Llama's: no attention options, the output projection with its bias.
attention_options, attention_out = llama.attention_options, llama.attention_out


def rope(c: Config) -> None:
    return None  # learned absolute positions, added in `embed`


def embed(params: dict, tokens: jax.Array, positions: jax.Array, c: Config,
          policy: Policy) -> jax.Array:
    return (quant.lookup(params["wte"], tokens) + params["wpe"][positions]).astype(policy.dtype)


def attn_norm(p: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return layer_norm(x, p["ln1_w"], p["ln1_b"], c.layer_norm_eps)


def qkv(p: dict, x: jax.Array, c: Config, policy: Policy) -> tuple[jax.Array, jax.Array, jax.Array]:
    y = policy.einsum("BTD,DINH->BTINH", x, p["wqkv"]) + p["bqkv"]  # I indexes q, k, v
    return y[:, :, 0], y[:, :, 1], y[:, :, 2]


def mlp_norm(p: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return layer_norm(x, p["ln2_w"], p["ln2_b"], c.layer_norm_eps)


def mlp(p: dict, x: jax.Array, c: Config, rules: Rules, policy: Policy) -> jax.Array:
    h = jax.nn.gelu(policy.einsum("BTD,DF->BTF", x, p["w_fc"]) + p["b_fc"], approximate=True)
    h = constrain(h, rules, "batch", "seq", "act_mlp")
    return policy.einsum("BTF,FD->BTD", h, p["w_proj"]) + p["b_proj"]


def final_norm(params: dict, x: jax.Array, c: Config, policy: Policy) -> jax.Array:
    return layer_norm(x, params["lnf_w"], params["lnf_b"], c.layer_norm_eps)


def unembedding(params: dict) -> Unembedding:
    """The token embedding [V, D], tied."""
    return Unembedding(params["wte"], vocab_first=True)


def from_hf(tensors: dict[str, np.ndarray], c: Config) -> dict:
    """transformers' GPT-2 uses Conv1D: weights are stored [in, out]."""
    D, N, H = c.hidden_size, c.num_heads, c.head_dim
    t = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    layers = []
    for i in range(c.num_layers):
        b = f"h.{i}."
        layers.append({
            "ln1_w": t[b + "ln_1.weight"], "ln1_b": t[b + "ln_1.bias"],
            "wqkv": t[b + "attn.c_attn.weight"].reshape(D, 3, N, H),
            "bqkv": t[b + "attn.c_attn.bias"].reshape(3, N, H),
            "wo": t[b + "attn.c_proj.weight"].reshape(N, H, D),
            "bo": t[b + "attn.c_proj.bias"],
            "ln2_w": t[b + "ln_2.weight"], "ln2_b": t[b + "ln_2.bias"],
            "w_fc": t[b + "mlp.c_fc.weight"], "b_fc": t[b + "mlp.c_fc.bias"],
            "w_proj": t[b + "mlp.c_proj.weight"], "b_proj": t[b + "mlp.c_proj.bias"],
        })
    return {"wte": t["wte.weight"], "wpe": t["wpe.weight"], "layers": layers,
            "lnf_w": t["ln_f.weight"], "lnf_b": t["ln_f.bias"]}
