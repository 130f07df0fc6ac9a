"""A Hugging Face model folder or a GGUF file converted into a podrun checkpoint (store.py), or a
randomly initialised one. GGUF weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are
dequantised at import. The command: python -m runner.tools.convert.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from models import weights
from models.registry import Model
from runner.checkpoints import store
from runner.checkpoints.gguf_source import read_gguf
from runner.checkpoints.hf_folder import read_hf_folder
from runner.checkpoints.source import Source, SourceError
from runner.text import o200k, tokenizer
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import Rules


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


def convert(source: str, output: str, dtype: str = "float32") -> store.Metadata:
    src = read_source(source)
    try:
        model = Model.from_hf_config(src.config)
    except (KeyError, ValueError) as e:
        raise SourceError(f"{source}: cannot read the architecture from its config ({e})") from e
    try:
        params = model.module.from_hf(src.tensors, model.config)
    except KeyError as e:
        raise SourceError(f"{source}: tensor {e} is missing for a {src.model_type} model") from e
    params = jax.tree.map(lambda a: np.asarray(a, dtype=dtype), params)

    files = dict(src.tokenizer_files)
    if src.gguf_path:
        text, tok_config = tokenizer.tokenizer_json_from_gguf(src.gguf_path)
        files["tokenizer.json"] = text.encode()
        files["tokenizer_config.json"] = json.dumps(tok_config).encode()
    _write(output, store.Metadata(model, {"files": sorted(files)}, source=str(source)), params, files)
    return store.Metadata(model, {"files": sorted(files)}, source=str(source))


def random_checkpoint(spec: str, output: str, seed: int = 0) -> store.Metadata:
    """A randomly initialised checkpoint of a preset (with the o200k_harmony tokenizer when the
    model's vocabulary is that size): a real end-to-end run without downloading a model."""
    model = Model.named(spec)
    rules = Rules.make(make_mesh(MeshShape(data=1), jax.devices()[:1]))
    params = weights.init(model.declare(), jax.random.key(seed), rules, jnp.float32)
    files = {}
    if getattr(model.config, "vocab_size", 0) == o200k.VOCAB_SIZE:
        files = o200k.tokenizer_files()
    meta = store.Metadata(model, {"files": sorted(files)}, source=f"random:{spec}:{seed}")
    _write(output, meta, params, files)
    return meta


def _write(output: str, meta: store.Metadata, params, files: dict[str, bytes]) -> None:
    out = epath.Path(output)
    local = "://" not in str(output)
    staging = out.parent / (out.name + ".converting") if local else out
    if local and staging.exists():
        shutil.rmtree(staging)
    store.save(str(staging), meta, params, files)
    if local:  # appear whole or not at all
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
