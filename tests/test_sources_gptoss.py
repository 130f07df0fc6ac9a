"""runner/checkpoints/ on gpt-oss folders against transformers: MXFP4 expert blocks dequantised by
transformers' own convert_moe_packed_tensors, a quantised folder written here (blocks packed by a
quantiser of this file) loaded by transformers' from_pretrained (which dequantises MXFP4 on CPU),
and an unquantised folder from save_pretrained."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import save_file
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from runner.checkpoints import mxfp4
from runner.checkpoints.convert import read_source
from runner.checkpoints.hf_folder import read_hf_folder
from runner.checkpoints.source import SourceError

EXPERTS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]  # as in openai/gpt-oss-20b's config.json


# --- helpers --------------------------------------------------------------------------------------


def tiny_gpt_oss() -> transformers.GptOssForCausalLM:
    """hidden 64 != intermediate 96, so a transposed expert tensor has the wrong shape."""
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.GptOssForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():  # norms, sinks and biases start constant; make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def quantise_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[E, R, C] float -> blocks [E, R, C/32, 16] uint8 and e8m0 scales [E, R, C/32] uint8, per
    the OCP MX spec: each 32 values of a row share 2^k with k = ceil(log2(amax / 6)), each value
    is the nearest FP4 e2m1 code, and element 2i goes to the low nibble of byte i."""
    e, r, c = w.shape
    groups = w.reshape(e, r, c // 32, 32).astype(np.float64)
    amax = np.abs(groups).max(-1, keepdims=True)
    k = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6)), -127, 127)
    table = np.array(FP4_VALUES)
    codes = np.abs(groups[..., None] / 2.0**k[..., None] - table).argmin(-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (k[..., 0] + 127).astype(np.uint8)


def reference_dequant(blocks: np.ndarray, scales: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                     dtype=dtype)
    return bits(out)


def bits(t) -> np.ndarray:
    """Raw bits, so -0.0 vs 0.0 and NaN payloads count too."""
    if isinstance(t, torch.Tensor):
        t = (t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16
             else t.numpy())
    return t.view(np.uint16 if t.dtype.itemsize == 2 else np.uint32)


def write_quantised_folder(model: transformers.GptOssForCausalLM, path: str) -> dict:
    """Like openai/gpt-oss-*: bf16 tensors, experts as MXFP4 blocks/scales/bias, two shards with
    layer 0's gate_up blocks and scales in different ones. Returns what was written."""
    written = {}
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name.rsplit(".", 1)[-1] in EXPERTS:  # [E, D, 2F] / [E, F, D], packed along axis 1
            written[f"{name}_blocks"], written[f"{name}_scales"] = quantise_mxfp4(
                np.ascontiguousarray(a.transpose(0, 2, 1)))
        else:
            written[name] = a.astype(ml_dtypes.bfloat16)
    first = {k for k in written if k.startswith("model.layers.0.") and "scales" not in k}
    shards = {"model-00001-of-00002.safetensors": {k: written[k] for k in first},
              "model-00002-of-00002.safetensors": {k: v for k, v in written.items()
                                                   if k not in first}}
    for file, part in shards.items():
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, part in shards.items()
                                                  for k in part}}, f)
    config = model.config.to_dict() | {"dtype": "bfloat16", "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return written


def write_experts(path: str, tensors: dict[str, np.ndarray]) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "gpt_oss"}, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))


# --- MXFP4 dequantisation -------------------------------------------------------------------------


@pytest.mark.parametrize("scale_range", ["realistic", "extremes"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("chunk", [1, 1 << 24])  # one expert per chunk, or all at once
def test_mxfp4_blocks_dequantise_like_transformers(tmp_path, monkeypatch, scale_range, dtype,
                                                   chunk):
    monkeypatch.setattr(mxfp4, "_MXFP4_CHUNK", chunk)
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (5, 40, 3, 16), dtype=np.uint8)  # 5 experts, 40 rows, 96 cols
    assert set(np.unique(blocks & 15)) == set(np.unique(blocks >> 4)) == set(range(16))
    if scale_range == "realistic":  # 2^-30 .. 2^10
        scales = rng.integers(127 - 30, 127 + 11, blocks.shape[:-1], dtype=np.uint8)
    else:  # subnormal bf16 results (0.5 * 2^-127) up to the largest finite, 6 * 2^125
        scales = rng.choice(np.array([0, 1, 2, 3, 126, 127, 128, 251, 252], np.uint8),
                            blocks.shape[:-1])
    name = "model.layers.3.mlp.experts.gate_up_proj"
    write_experts(tmp_path, {f"{name}_blocks": blocks, f"{name}_scales": scales})

    got = read_hf_folder(str(tmp_path), expert_dtype=dtype).tensors
    assert list(got) == [name]
    want = reference_dequant(blocks, scales, getattr(torch, dtype))
    assert got[name].shape == (5, 96, 40) and got[name].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(bits(got[name]), want)


@pytest.mark.parametrize("scale", [253, 254, 255])
def test_mxfp4_values_beyond_bfloat16_range_are_refused(tmp_path, scale):
    """transformers turns these into inf (6 * 2^126 and up) and NaN (0 * 2^128): refused."""
    blocks = np.full((2, 4, 1, 16), 0x70, np.uint8)  # 0.0 and 6.0
    scales = np.full((2, 4, 1), 127, np.uint8)
    scales[1, 2, 0] = scale
    name = "model.layers.0.mlp.experts.down_proj"
    write_experts(tmp_path, {f"{name}_blocks": blocks, f"{name}_scales": scales})
    assert not np.isfinite(reference_dequant(blocks, scales, torch.float32).view(np.float32)).all()
    with pytest.raises(SourceError, match=f"{name}.*beyond"):
        read_hf_folder(str(tmp_path))


# --- gpt-oss folders ------------------------------------------------------------------------------


def test_quantised_gpt_oss_folder_reads_as_transformers_loads_it(tmp_path):
    model = tiny_gpt_oss()
    written = write_quantised_folder(model, str(tmp_path))
    for name, text in (("chat_template.jinja", "{{ messages }}"),
                       ("tokenizer_config.json", '{"eos_token": "<|return|>"}'),
                       ("generation_config.json", '{"eos_token_id": [2, 3]}')):
        (tmp_path / name).write_text(text)

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager", output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert type(loaded.model.layers[0].mlp.experts).__name__ == "GptOssExperts"  # dequantised
    want = {k: bits(v) for k, v in loaded.state_dict().items()}

    src = read_source(str(tmp_path))
    assert src.model_type == "gpt_oss"
    assert sorted(src.tensors) == sorted(want)
    for name, a in src.tensors.items():
        assert a.dtype == ml_dtypes.bfloat16 and a.shape == want[name].shape, name
        np.testing.assert_array_equal(bits(a), want[name], err_msg=name)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert f"{name}_blocks" in written and name not in written  # experts came from blocks
    # and independently of transformers: the quantised experts are close to the model's own
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[-1] in EXPERTS:
            w, q = t.numpy(), src.tensors[name].astype(np.float32)
            assert np.linalg.norm(q - w) < 0.2 * np.linalg.norm(w), name

    cfg = src.config
    assert cfg["num_local_experts"] == 4 and cfg["num_experts_per_tok"] == 2
    assert cfg["sliding_window"] == 8
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    assert set(src.tokenizer_files) == {"chat_template.jinja", "tokenizer_config.json",
                                        "generation_config.json"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantised_gpt_oss_folder_reads_back_as_the_state_dict(tmp_path, dtype):
    model = tiny_gpt_oss().to(dtype)
    model.save_pretrained(tmp_path)
    src = read_hf_folder(str(tmp_path))
    want = {k: bits(v) for k, v in model.state_dict().items()}
    assert sorted(src.tensors) == sorted(want)
    for name, a in src.tensors.items():
        np.testing.assert_array_equal(bits(a), want[name], err_msg=name)
    shapes = {k.replace("layers.1.", "layers.N."): v.shape for k, v in src.tensors.items()
              if "layers.0." not in k}
    assert shapes["model.layers.N.mlp.experts.gate_up_proj"] == (4, 64, 2 * 96)  # [E, D, 2F]
    assert shapes["model.layers.N.mlp.experts.down_proj"] == (4, 96, 64)  # [E, F, D]
    assert shapes["model.layers.N.self_attn.sinks"] == (8,)  # per query head


# --- bad pairs ------------------------------------------------------------------------------------


def bad_pair(case: str) -> tuple[dict[str, np.ndarray], str]:
    name = "model.layers.1.mlp.experts.down_proj"
    blocks = np.zeros((2, 64, 3, 16), np.uint8)
    scales = np.full((2, 64, 3), 127, np.uint8)
    return {
        "blocks_without_scales": ({f"{name}_blocks": blocks}, f"{name}_blocks has no"),
        "scales_without_blocks": ({f"{name}_scales": scales}, f"{name}_scales has no"),
        "scales_of_another_shape": ({f"{name}_blocks": blocks, f"{name}_scales": scales[:, :, :2]},
                                    f"{name}: _blocks .* do not pair"),
        "blocks_not_uint8": ({f"{name}_blocks": blocks.astype(np.int8), f"{name}_scales": scales},
                             f"{name}: _blocks is int8"),
        "bias_of_another_shape": ({f"{name}_blocks": blocks, f"{name}_scales": scales,
                                   f"{name}_bias": np.zeros((2, 96), np.float32)},
                                  f"{name}: {name}_bias is"),
    }[case]


@pytest.mark.parametrize("case", ["blocks_without_scales", "scales_without_blocks",
                                  "scales_of_another_shape", "blocks_not_uint8",
                                  "bias_of_another_shape"])
def test_bad_mxfp4_pairs_raise_source_error_naming_tensor_and_file(tmp_path, case):
    tensors, message = bad_pair(case)
    write_experts(tmp_path, tensors)
    with pytest.raises(SourceError, match=message) as e:
        read_hf_folder(str(tmp_path))
    assert str(tmp_path / "model.safetensors") in str(e.value)
