"""Converts an HF checkpoint folder or a GGUF file into a podrun checkpoint.

    python -m runner.convert --source=<HF folder | file.gguf> --output=<dir> [--dtype=float32]
    python -m runner.convert --random=gptoss:tiny-o200k --output=<dir>   # random weights, for tests

GGUF weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are dequantised at import.
"""

from __future__ import annotations

import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from etils import epath

from models import weights
from models.registry import Model
from runner import checkpoint, sources, tokenizer
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import Rules



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
    _write(output, checkpoint.Metadata(model, {"files": sorted(files)}, source=str(source)), params, files)
    return checkpoint.Metadata(model, {"files": sorted(files)}, source=str(source))


def random_checkpoint(spec: str, output: str, seed: int = 0) -> checkpoint.Metadata:
    """A randomly initialised checkpoint of a preset (with the o200k_harmony tokenizer when the
    model's vocabulary is that size): a real end-to-end run without downloading a model."""
    from runner import harmony  # the o200k_harmony vocabulary is only built when asked for

    model = Model.named(spec)
    rules = Rules.make(make_mesh(MeshShape(data=1), jax.devices()[:1]))
    params = weights.init(model.declare(), jax.random.key(seed), rules, jnp.float32)
    files = {}
    if getattr(model.config, "vocab_size", 0) == harmony.VOCAB_SIZE:
        files = harmony.tokenizer_files()
    meta = checkpoint.Metadata(model, {"files": sorted(files)}, source=f"random:{spec}:{seed}")
    _write(output, meta, params, files)
    return meta


def _write(output: str, meta: checkpoint.Metadata, params, files: dict[str, bytes]) -> None:
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


def main(argv: list[str]) -> None:
    del argv
    from runner.log import quiet

    quiet()
    if not (_SOURCE.value or _RANDOM.value) or not _OUTPUT.value:
        sys.exit("podrun convert: error: --source (or --random) and --output are required")
    try:
        if _RANDOM.value:
            meta = random_checkpoint(_RANDOM.value, _OUTPUT.value)
        else:
            meta = convert(_SOURCE.value, _OUTPUT.value, _DTYPE.value)
    except (sources.SourceError, checkpoint.CheckpointError, tokenizer.TokenizerError, ValueError) as e:
        sys.exit(f"podrun convert: error: {e}")
    print(f"converted {_SOURCE.value or _RANDOM.value} -> {_OUTPUT.value}: {meta.model.family} {meta.model.config}")


if __name__ == "__main__":  # flags of this command only, so the module can be imported
    _SOURCE = flags.DEFINE_string("source", None,
                                  "HF checkpoint folder (config.json + safetensors) or .gguf file")
    _RANDOM = flags.DEFINE_string("random", None,
                                  "family:preset to initialise randomly instead of --source")
    _OUTPUT = flags.DEFINE_string("output", None, "directory to write the podrun checkpoint to")
    _DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"],
                               "stored weight dtype")
    app.run(main)
