"""Converts an HF checkpoint folder or a GGUF file into a podrun checkpoint.

    python -m runner.tools.convert --source=<HF folder | file.gguf> --output=<dir> [--dtype=float32]
    python -m runner.tools.convert --random=gptoss:tiny-o200k --output=<dir>   # random weights, for tests

GGUF weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) are dequantised at import.
"""

from __future__ import annotations

import sys

from absl import app, flags

from runner.checkpoints import store
from runner.checkpoints.convert import convert, random_checkpoint
from runner.checkpoints.source import SourceError
from runner.log import quiet
from runner.text import tokenizer


def main(argv: list[str]) -> None:
    del argv
    quiet()
    if not (_SOURCE.value or _RANDOM.value) or not _OUTPUT.value:
        sys.exit("podrun convert: error: --source (or --random) and --output are required")
    try:
        if _RANDOM.value:
            meta = random_checkpoint(_RANDOM.value, _OUTPUT.value)
        else:
            meta = convert(_SOURCE.value, _OUTPUT.value, _DTYPE.value)
    except (SourceError, store.CheckpointError, tokenizer.TokenizerError, ValueError) as e:
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
