"""What a checkpoint source is read into: numpy arrays under Hugging Face state-dict names.

A source is a Hugging Face model folder (hf_folder.py) or one llama.cpp .gguf file
(gguf_source.py). Either way the result is a `Source`: the HF model_type, an HF config.json-style
dict, {HF tensor name: array} and the tokenizer files to copy, so that one converter
(convert.py) maps HF names to the model's parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class SourceError(ValueError):
    """The source is missing, unreadable, or holds something podrun cannot read."""


@dataclasses.dataclass
class Source:
    model_type: str  # HF model_type: "llama", "qwen2", "gpt2"
    config: dict  # HF config.json keys
    tensors: dict[str, np.ndarray]  # HF state-dict name -> array (float32, float16 or bfloat16)
    tokenizer_files: dict[str, bytes]  # file name -> contents, to copy next to the checkpoint
    gguf_path: str | None = None  # the .gguf file, when the source is one
