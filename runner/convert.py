"""Converts an HF checkpoint folder or a GGUF file into a podrun checkpoint.

    python -m runner.convert --source=<HF folder | file.gguf> --output=<dir> [--dtype=float32]

GGUF weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are dequantised at import.
"""

from __future__ import annotations

import json
import shutil
import sys

import jax
import numpy as np
from absl import app, flags
from etils import epath

from models.registry import Model
from runner import checkpoint, sources, tokenizer

_SOURCE = flags.DEFINE_string("source", None, "HF checkpoint folder (config.json + safetensors) or .gguf file")
_OUTPUT = flags.DEFINE_string("output", None, "directory to write the podrun checkpoint to")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "stored weight dtype")


def convert(source: str, output: str, dtype: str = "float32") -> checkpoint.Metadata:
    src = sources.read_source(source)
    try:
        model = Model.from_hf_config(src.config)
    except (KeyError, ValueError) as e:
        raise sources.SourceError(f"{source}: cannot read the architecture from its config ({e})") from e
    try:
        params = model.module.from_hf(src.tensors, model.config)
    except KeyError as e:
        raise sources.SourceError(f"{source}: tensor {e} is missing for a {src.model_type} model") from e
    params = jax.tree.map(lambda a: np.asarray(a, dtype=dtype), params)

    files = dict(src.tokenizer_files)
    if src.gguf_path:
        text, tok_config = tokenizer.tokenizer_json_from_gguf(src.gguf_path)
        files["tokenizer.json"] = text.encode()
        files["tokenizer_config.json"] = json.dumps(tok_config).encode()
    meta = checkpoint.Metadata(model, {"files": sorted(files)}, source=str(source))

    out = epath.Path(output)
    local = "://" not in str(output)
    staging = out.parent / (out.name + ".converting") if local else out
    if local and staging.exists():
        shutil.rmtree(staging)
    checkpoint.save(str(staging), meta, params, files)
    if local:  # appear whole or not at all
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return meta


def main(argv: list[str]) -> None:
    del argv
    if not _SOURCE.value or not _OUTPUT.value:
        sys.exit("podrun convert: error: --source and --output are required")
    try:
        meta = convert(_SOURCE.value, _OUTPUT.value, _DTYPE.value)
    except (sources.SourceError, checkpoint.CheckpointError, tokenizer.TokenizerError) as e:
        sys.exit(f"podrun convert: error: {e}")
    print(f"converted {_SOURCE.value} -> {_OUTPUT.value}: {meta.model.family} {meta.model.config}")


if __name__ == "__main__":
    app.run(main)
