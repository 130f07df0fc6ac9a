"""A llama.cpp .gguf file read as a `Source`: an HF config built from its metadata, and its
tensors in HF names and layout. Tensors of every type gguf's own dequantiser reads (whatever the
installed gguf knows: the Q, K, IQ and TQ quants, MXFP4, ...) become float32, as F64 does; F16 and
BF16 keep their dtype. llama.cpp's row permutation of llama q/k projections is undone, and GPT-2's
Conv1D weights get their [in, out] layout back. References for names and layouts: llama.cpp's
convert_hf_to_gguf.py, transformers' modeling_gguf_pytorch_utils.py.
"""

from __future__ import annotations

import re
import struct
from importlib.metadata import version as _version

import ml_dtypes
import numpy as np

from runner.checkpoints.gguf_file import GGUFFile
from runner.checkpoints.source import Source, SourceError

_GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "gpt2": ("gpt2", "GPT2LMHeadModel")}
# GGUF tensor name (without .weight/.bias) -> HF module name; {i} is the block index.
_LLAMA_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"} | {k: "model.layers.{i}." + v for k, v in {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}.items()}
_GPT2_NAMES = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
               "output_norm": "transformer.ln_f", "output": "lm_head"} | {
    k: "transformer.h.{i}." + v for k, v in {
        "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}.items()}
_GPT2_CONV1D = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")  # stored as Linear [out, in]


def read_gguf(path: str) -> Source:
    """An HF config built from the GGUF metadata, and its tensors in HF names and layout."""
    import gguf  # 1.2 s to import: only GGUF sources pay it

    try:
        reader = GGUFFile(path)
    except (OSError, ValueError, IndexError, KeyError, struct.error) as e:  # missing, truncated
        raise SourceError(f"{path}: not a readable GGUF file, truncated or corrupt ({e})") from e

    def meta(key: str, default=None):
        return reader.metadata.get(key, default)

    arch = meta("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise SourceError(f"{path}: GGUF architecture {arch!r} is not supported; "
                          f"supported: {sorted(_GGUF_ARCHS)}")
    if meta("split.count", 1) > 1:
        raise SourceError(f"{path}: a split GGUF; merge it first (llama-gguf-split --merge)")
    model_type, hf_class = _GGUF_ARCHS[arch]

    raw = {t.name: t for t in reader.tensors}
    n_vocab = meta(f"{arch}.vocab_size")
    if n_vocab is None and "tokenizer.ggml.tokens" in reader.metadata:
        n_vocab = len(reader.metadata["tokenizer.ggml.tokens"])
    if n_vocab is None and "token_embd.weight" in raw:
        n_vocab = int(raw["token_embd.weight"].shape[-1])  # ggml order: [D, V]
    hidden, heads = meta(f"{arch}.embedding_length"), meta(f"{arch}.attention.head_count")
    if hidden is None or heads is None:
        raise SourceError(f"{path}: GGUF metadata lacks {arch}.embedding_length or head_count")
    cfg = {"architectures": [hf_class], "model_type": model_type, "vocab_size": n_vocab,
           "tie_word_embeddings": "output.weight" not in raw}
    if arch == "gpt2":
        cfg |= {"n_embd": hidden, "n_layer": meta("gpt2.block_count"), "n_head": heads,
                "n_positions": meta("gpt2.context_length"),
                "n_inner": meta("gpt2.feed_forward_length"), "activation_function": "gelu_new",
                "layer_norm_epsilon": meta("gpt2.attention.layer_norm_epsilon", 1e-5)}
    else:
        kv_heads = meta(f"{arch}.attention.head_count_kv", heads)
        cfg |= {"hidden_size": hidden, "intermediate_size": meta(f"{arch}.feed_forward_length"),
                "num_hidden_layers": meta(f"{arch}.block_count"), "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "head_dim": (meta(f"{arch}.attention.key_length")
                             or meta(f"{arch}.rope.dimension_count") or hidden // heads),
                "rms_norm_eps": meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
                "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
                "max_position_embeddings": meta(f"{arch}.context_length"), "hidden_act": "silu",
                "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in raw}
        scaling = _rope_scaling(meta, arch, path)
        if (freqs := raw.get("rope_freqs.weight")) is not None:
            factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).reshape(-1)
            scaling = _llama3_rope_scaling(factors, cfg["rope_theta"], cfg["head_dim"], path)
        if scaling:
            cfg["rope_scaling"] = scaling
    for key, hf_key in (("ggml.bos_token_id", "bos_token_id"),
                        ("ggml.eos_token_id", "eos_token_id"),
                        ("ggml.padding_token_id", "pad_token_id")):
        if (v := meta(f"tokenizer.{key}")) is not None:
            cfg[hf_key] = v

    names = _GPT2_NAMES if arch == "gpt2" else _LLAMA_NAMES
    tensors = {}
    for name, t in raw.items():
        if name == "rope_freqs.weight":
            continue
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", name)
        if m is None or m[2] not in names or ("{i}" in names[m[2]]) != (m[1] is not None):
            raise SourceError(f"{path}: tensor {name} has no Hugging Face {model_type} equivalent")
        a = _gguf_array(gguf, t, path)
        if arch == "llama" and m[2] in ("attn_q", "attn_k"):
            a = _unpermute_rope(a, heads if m[2] == "attn_q" else cfg["num_key_value_heads"])
        if arch == "gpt2" and m[2] in _GPT2_CONV1D and m[3] == "weight":
            a = np.ascontiguousarray(a.T)
        tensors[f"{names[m[2]].format(i=m[1])}.{m[3]}"] = a
    embed = tensors.get(f"{names['token_embd']}.weight")
    if embed is not None and np.array_equal(tensors.get("lm_head.weight"), embed):
        del tensors["lm_head.weight"]  # llama.cpp writes GPT-2's tied unembedding as a copy
        cfg["tie_word_embeddings"] = True
    return Source(model_type, cfg, tensors, {}, gguf_path=path)


def _gguf_array(gguf, t, path: str) -> np.ndarray:
    """One tensor in HF (row-major) shape: GGUF lists dims fastest-first, the reverse of numpy.
    Any type gguf.quants.dequantize knows is read; it raises NotImplementedError for the others."""
    shape = tuple(int(d) for d in reversed(t.shape))
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        a = np.asarray(t.data)
    elif kind == "BF16":
        a = np.asarray(t.data).view(ml_dtypes.bfloat16)  # the reader gives the raw bytes
    elif kind == "F64":
        a = np.asarray(t.data, np.float32)
    else:
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        except NotImplementedError:
            raise SourceError(
                f"{path}: tensor {t.name} is {kind}, which gguf {_version('gguf')} cannot "
                "dequantise; upgrade gguf (pip install -U gguf) or requantise the file to a type "
                "it reads (llama-quantize --allow-requantize IN OUT Q8_0)") from None
    if a.size != int(np.prod(shape)):
        raise SourceError(f"{path}: tensor {t.name} is truncated ({a.size} of {shape} values)")
    return a.reshape(shape)


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's permute(): per head it interleaves the rotate-half halves of the rows,
    HF row h*H + i*H/2 + j -> GGUF row h*H + 2j + i (i: which half, j: pair index)."""
    rows = w.shape[0]
    g = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [N, H/2, 2, ...]
    return np.ascontiguousarray(g.swapaxes(1, 2).reshape(w.shape))  # [N, 2, H/2, ...]


def _rope_scaling(meta, arch: str, path: str) -> dict | None:
    kind = meta(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = meta(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta(f"{arch}.rope.scaling.original_context_length")
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("attn_factor", "attention_factor")):
            if (v := meta(f"{arch}.rope.scaling.{gguf_key}")) is not None:
                out[hf_key] = v
        return out
    raise SourceError(f"{path}: rope scaling type {kind!r} is not supported (linear, yarn, and "
                      "llama3 via rope_freqs are)")


def _llama3_factors(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    """Per-frequency divisor of HF's llama3 rope (transformers' _compute_llama3_parameters)."""
    old, low, high = (s["original_max_position_embeddings"], s["low_freq_factor"],
                      s["high_freq_factor"])
    wavelen = 2 * np.pi / inv_freq
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / s["factor"] + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, s["factor"], mid))


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int,
                         path: str) -> dict | None:
    """HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor (one divisor per frequency).
    Only the ratios old/low and old/high matter, so old context is fixed at llama.cpp's 8192 and
    low/high are fitted on the smoothly interpolated frequencies, then checked by recomputing."""
    factors = factors.astype(np.float64)
    if factors.shape != (head_dim // 2,):
        raise SourceError(f"{path}: rope_freqs has {factors.size} values, expected {head_dim // 2}")
    if np.allclose(factors, 1.0):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor, old = float(factors.max()), 8192
    mid = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0  # Llama 3.x's values, used when too few points lie in between
    if mid.sum() >= 2:  # 1/f = (1-s)/factor + s, and s = (old/wavelen - low) / (high - low)
        s = (1 / factors[mid] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(old * inv_freq[mid] / (2 * np.pi), s, 1)
        low = round(-intercept / slope, 4)
        high = round(low + 1 / slope, 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old}
    if not np.allclose(_llama3_factors(inv_freq, scaling), factors, rtol=1e-4):
        raise SourceError(f"{path}: rope_freqs matches no llama3 rope scaling; this GGUF's rope "
                          "scaling is not supported (convert from the Hugging Face folder instead)")
    return scaling
