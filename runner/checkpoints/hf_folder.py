"""A Hugging Face model folder (config.json + safetensors, or pytorch_model.bin) read as a
`Source`: every tensor under its HF name, and the tokenizer files (the chat template among them).
MXFP4 expert weights (gpt-oss's `<name>_blocks` + `<name>_scales`) are dequantised under `<name>`
(mxfp4.py), so quantised and unquantised folders read alike.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from runner.checkpoints import mxfp4
from runner.checkpoints.source import Source, SourceError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "vocab.json", "merges.txt")

_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


def read_hf_folder(path: str, *, expert_dtype: str = "bfloat16") -> Source:
    """config.json, every tensor of the (sharded) safetensors or .bin, and the tokenizer files.
    MXFP4 pairs `<name>_blocks` / `<name>_scales` come back as `<name>` in expert_dtype
    ("bfloat16", exact like transformers' dequantiser, or "float32")."""
    if expert_dtype not in mxfp4.EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={expert_dtype!r}; use one of {sorted(mxfp4.EXPERT_DTYPES)}")
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
    mxfp4.dequantise(tensors, origin, mxfp4.EXPERT_DTYPES[expert_dtype])
    files = {}
    for name in TOKENIZER_FILES:
        if os.path.isfile(p := os.path.join(path, name)):
            with open(p, "rb") as f:
                files[name] = f.read()
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

