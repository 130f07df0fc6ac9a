"""runner/checkpoints/'s HF folder and GGUF readers against independent references: transformers'
own loaders (HF folders and GGUF), GGUF files written here the way llama.cpp's convert_hf_to_gguf.py
writes them (names from gguf's own tensor map, its permute and transposes), gguf's quantisers and
dequantisers (every tensor type the installed gguf reads; random blocks for those it only reads),
and K-quant blocks packed here from the ggml block layouts (ggml-common.h,
dequantize_row_q{4,5,6}_K)."""

from __future__ import annotations

import os
import re

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from models.llama import PRESETS as LLAMA_PRESETS
from models.policy import Policy
from models.registry import Model
from runner.checkpoints import store
from runner.checkpoints.convert import convert, read_source
from runner.checkpoints.gguf_file import GGUFFile
from runner.checkpoints.gguf_source import read_gguf
from runner.checkpoints.hf_folder import read_hf_folder
from runner.checkpoints.source import SourceError
from tests.conftest import rules_for
from tests.forward import prompt_logits
from tests.reference import GGUFReference, transformers_gguf_load

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "gpt2": gguf.MODEL_ARCH.GPT2}


# --- fixtures and helpers -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, smollm2_transformers):
    return read_source(smollm2_gguf), *smollm2_transformers.loaded


def tiny_hf_model(arch: str, **kw) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      bos_token_id=1, eos_token_id=2, **kw)
    else:
        cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
        cfg = cls(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 5e5,
                     "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": arch == "qwen2",
                     **kw})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms and biases start at 1/0; make every tensor distinguishable
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def state_of(model) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def llama_cpp_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order of llama.cpp's LlamaModel.permute: GGUF row h*H + 2j + i holds HF row
    h*H + i*H/2 + j (i: which rotate-half half, j: the pair)."""
    hd = n_rows // n_heads
    return np.array([h * hd + i * (hd // 2) + j
                     for h in range(n_heads) for j in range(hd // 2) for i in range(2)])


def gguf_dequantises(qtype) -> bool:
    """Whether gguf.quants.dequantize reads qtype (it raises NotImplementedError for the others)."""
    try:
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def gguf_quantises(qtype) -> bool:
    """Whether gguf.quants.quantize writes qtype (NotImplementedError for the others)."""
    try:
        gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][0]), np.float32), qtype)
    except NotImplementedError:
        return False
    return True


def random_blocks(qtype, shape: tuple[int, ...], rng) -> np.ndarray:
    """Random blocks of qtype for `shape` values, as bytes [..., row bytes]. Where gguf dequantises
    qtype, a block it reads as NaN or inf (an f16 scale of all-ones exponent, an MXFP4 exponent
    too large) is drawn again, until every value is finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (int(np.prod(shape)) // block, size), dtype=np.uint8)
    for _ in range(50):
        if not gguf_dequantises(qtype):
            break
        with np.errstate(invalid="ignore", over="ignore"):
            bad = ~np.isfinite(gguf.quants.dequantize(b, qtype)).all(axis=1)
        if not bad.any():
            break
        b[bad] = rng.integers(0, 256, (int(bad.sum()), size), dtype=np.uint8)
    else:
        raise AssertionError(f"no finite {qtype.name} blocks drawn")
    return b.reshape(*shape[:-1], shape[-1] // block * size)


def stored_as(qtype, a: np.ndarray, rng) -> tuple[np.ndarray, object]:
    """(data, raw_dtype) for GGUFWriter.add_tensor storing float32 `a` as qtype: gguf's quantiser
    where it has one, random blocks (random_blocks) for the types gguf only dequantises."""
    floats = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64}
    if qtype in floats:
        return a.astype(floats[qtype]), None
    try:
        return gguf.quants.quantize(a, qtype), qtype
    except NotImplementedError:
        return random_blocks(qtype, a.shape, rng), qtype


def write_gguf(path, arch: str, config, state: dict[str, np.ndarray], encode=None,
               extra: dict[str, np.ndarray] | None = None, kv: dict | None = None,
               types: dict | None = None) -> str:
    """A GGUF as convert_hf_to_gguf.py writes one. encode(hf_name, gguf_layout_array) may return
    (data, raw_dtype) to store a tensor quantised; otherwise types {hf_name: GGMLQuantizationType}
    picks a tensor's type (stored_as), and the rest are stored as given (F32)."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(config.num_attention_heads)
    if arch == "gpt2":
        w.add_feed_forward_length(4 * config.hidden_size)
        w.add_layer_norm_eps(config.layer_norm_epsilon)
    else:
        w.add_feed_forward_length(config.intermediate_size)
        w.add_head_count_kv(config.num_key_value_heads)
        w.add_layer_norm_rms_eps(config.rms_norm_eps)
        w.add_rope_freq_base(config.rope_parameters["rope_theta"])
        w.add_rope_dimension_count(getattr(config, "head_dim", None)
                                   or config.hidden_size // config.num_attention_heads)
    if arch == "llama":
        w.add_vocab_size(config.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    for key, value in (kv or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_bool(key, value)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    for hf_name, a in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings and arch != "gpt2":
            continue  # llama.cpp writes GPT-2's tied head as a copy of wte, others not at all
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        if arch == "llama" and re.search(r"\.(q|k)_proj\.", hf_name):
            q = ".q_proj." in hf_name
            a = a[llama_cpp_rows(a.shape[0], config.num_attention_heads if q
                                 else config.num_key_value_heads)]
        if arch == "gpt2" and re.search(r"(c_attn|c_proj|c_fc)\.weight$", hf_name):
            a = a.T  # Conv1D [in, out] -> Linear [out, in]
        a = np.ascontiguousarray(a, dtype=np.float32)
        data, raw_dtype = (encode and encode(hf_name, a)) or (
            stored_as(types[hf_name], a, rng) if hf_name in (types or {}) else (a, None))
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def gguf_reference(path: str, arch: str, config, hf_names) -> dict[str, np.ndarray]:
    """The file's tensors as gguf's own reader and dequantiser give them (float32), in HF names
    and layout: llama's q/k rows put back in HF order, numpy shapes the reverse of GGUF's dims."""
    to_gguf = gguf.get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    hf = {to_gguf.get_name(n, try_suffixes=(".weight", ".bias")): n for n in hf_names}
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        data = np.asarray(t.data)
        a = (data.astype(np.float32) if t.tensor_type in (Q.F32, Q.F64)
             else gguf.quants.dequantize(data, t.tensor_type))
        a = a.reshape(tuple(reversed(t.shape.tolist())))
        name = hf[t.name]
        if arch == "llama" and re.search(r"\.(q|k)_proj\.weight$", name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            a = a[np.argsort(llama_cpp_rows(a.shape[0], heads))]
        out[name] = a
    return out


def hf_config_of(src) -> transformers.PretrainedConfig:
    fields = {k: v for k, v in src.config.items() if not k.startswith("podrun_")}
    return transformers.AutoConfig.for_model(**fields)


# --- the real SmolLM2 GGUF ------------------------------------------------------------------------

def test_smollm2_gguf_tensors_equal_transformers_own_gguf_load(smollm2):
    src, _, want, _ = smollm2
    assert src.model_type == "llama"
    assert set(src.tensors) == set(want) and "lm_head.weight" not in want  # tied
    for name, a in src.tensors.items():
        assert a.dtype == np.float32 and a.shape == want[name].shape, name
        np.testing.assert_allclose(a, want[name], rtol=0, atol=1e-7, err_msg=name)


def test_smollm2_gguf_config_agrees_with_transformers(smollm2):
    src, c, _, _ = smollm2
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert src.config[key] == getattr(c, key), key
    assert src.config["rope_theta"] == c.rope_parameters["rope_theta"]
    assert src.config["rms_norm_eps"] == pytest.approx(c.rms_norm_eps, rel=1e-6)
    assert Model.from_hf_config(src.config).config == LLAMA_PRESETS["smollm2-135m"]


def test_smollm2_gguf_leaves_its_tokenizer_to_the_gguf_file(smollm2, smollm2_gguf):
    src = smollm2[0]  # the tokenizer and chat template: tests/test_tokenizer.py
    assert src.tokenizer_files == {} and src.gguf_path == smollm2_gguf


# --- GGUF files written here ----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_gguf_of_a_random_hf_model_reads_back_as_its_state_dict(tmp_path, arch):
    model = tiny_hf_model(arch, **({"attention_bias": True} if arch == "llama" else {}))
    want = state_of(model)
    path = write_gguf(tmp_path / "m.gguf", arch, model.config, want)
    src = read_source(path)

    # The file is what llama.cpp would write: transformers' own GGUF loader gets the model back.
    _, ref, _ = transformers_gguf_load(path)
    assert len(ref) >= 8 * model.config.num_hidden_layers
    for name, a in ref.items():
        np.testing.assert_array_equal(a, want[name], err_msg=f"test writer: {name}")

    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(src.tensors) == set(want) - tied
    for name, a in src.tensors.items():
        np.testing.assert_array_equal(a, want[name], err_msg=name)
    assert src.model_type == arch
    assert src.config["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert Model.from_hf_config(src.config) == Model.from_hf_config(model.config.to_dict())
    c = hf_config_of(src)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert getattr(c, key) == getattr(model.config, key), key
    if arch != "gpt2":
        assert c.num_key_value_heads == model.config.num_key_value_heads
        assert c.rope_parameters["rope_theta"] == model.config.rope_parameters["rope_theta"]
        assert c.rms_norm_eps == model.config.rms_norm_eps


# Every tensor type gguf's dequantiser reads, as the installed gguf reports it (not a list kept
# here), less F32/F16/BF16 (read as they are), plus F64 (read by GGUFReader, narrowed to float32).
GGUF_READS = [t for t in Q if gguf_dequantises(t) and t not in (Q.F32, Q.F16, Q.BF16)] + [Q.F64]
# Worst |error| / max|x| of its block: half a step (Q4_0, Q5_0: a whole step at the clipped end),
# plus the rounding of the f16 scale; others gguf may quantise, half of max|x| (ternary TQ's
# step). A wrong layout or dequantiser errs by about max|x| itself.
QUANT_BOUND = {Q.Q8_0: 1 / 200, Q.Q4_0: 1 / 7.5, Q.Q4_1: 1 / 13, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 29,
               Q.MXFP4: 1 / 3.5, Q.TQ1_0: 1 / 1.9, Q.TQ2_0: 1 / 1.9}


def test_gguf_reads_the_types_of_llama_cpps_mixed_quantisations():
    """Q4_K_M and Q5_K_M files mix Q5_0, Q5_1 and Q8_0 in (for rows no K-quant block fits), and
    the IQ types are llama.cpp's own; all of them are among the types tested here."""
    assert {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
            Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL,
            Q.IQ4_XS} <= set(GGUF_READS)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16] + GGUF_READS, ids=lambda t: t.name)
def test_gguf_tensors_of_each_type_convert_to_ggufs_own_dequantisation(tmp_path, qtype):
    """Every matrix (lm_head and llama's permuted q/k too) stored as qtype: gguf's quantisation of
    the model's weights, or random blocks for the types it only dequantises. The source's tensors
    are what gguf's own reader and dequantiser make of the file, in HF layout."""
    model = tiny_hf_model("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1)
    orig = state_of(model)
    types = {n: qtype for n, a in orig.items() if a.ndim == 2}
    path = write_gguf(tmp_path / "q.gguf", "llama", model.config, orig, types=types)
    src = read_gguf(path)
    ref = gguf_reference(path, "llama", model.config, orig)
    assert len(types) == 9 and set(src.tensors) == set(ref) == set(orig)  # embed, lm_head, 7 more
    for name, got in src.tensors.items():
        x = orig[name]
        assert got.shape == x.shape, name
        if name not in types:
            np.testing.assert_array_equal(got, x, err_msg=name)
            continue
        want_dtype = {Q.F16: np.float16, Q.BF16: ml_dtypes.bfloat16}.get(qtype, np.float32)
        assert got.dtype == want_dtype, name
        np.testing.assert_array_equal(got.astype(np.float32), ref[name], err_msg=name)
        if qtype in (Q.F16, Q.BF16, Q.F64):
            np.testing.assert_array_equal(got, x.astype(want_dtype), err_msg=name)
        elif gguf_quantises(qtype):  # from the model's weights (else random blocks)
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            block_max = np.abs(x.reshape(-1, block)).max(axis=1, keepdims=True)
            err = np.abs(got - x).reshape(-1, block)
            assert (err <= QUANT_BOUND.get(qtype, 1 / 1.9) * block_max + 1e-7).all(), name


def test_qwen2_gguf_mixing_q5_0_and_q5_1_in_converts_and_runs_as_transformers_loads_it(tmp_path):
    """Issue 42: Qwen2.5-Coder-0.5B's Q4_K_M stores token_embd as Q5_0 (no K-quant block fits a
    row of 896). A tiny Qwen2 (rows of 64) quantised as llama.cpp's Q4_K_M falls back (Q5_0 for
    Q4_K, Q5_1 for Q5_K, Q8_0 for Q6_K) is converted, restored and run: its logits are those of
    transformers' own load of the same GGUF (through gguf's dequantiser)."""
    model = tiny_hf_model("qwen2")
    types = {n: Q.Q5_1 if ".v_proj." in n else Q.Q8_0 if ".down_proj." in n else Q.Q5_0
             for n, a in state_of(model).items() if a.ndim == 2}
    path = write_gguf(tmp_path / "q4_k_m.gguf", "qwen2", model.config, state_of(model), types=types)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert stored["token_embd.weight"] == Q.Q5_0 and stored["blk.0.attn_v.weight"] == Q.Q5_1
    convert(path, str(tmp_path / "ck"))

    meta = store.load_metadata(str(tmp_path / "ck"))
    rules = rules_for("1dev")
    params = store.restore(str(tmp_path / "ck"), meta.model, rules, "float32")
    ids = np.array([[1, 17, 42, 5, 88, 3, 60, 9]], np.int32)
    logits = prompt_logits(meta.model, params, rules, Policy(), ids)
    want = GGUFReference(path).model
    with torch.no_grad():
        ref = want(torch.tensor(ids)).logits.numpy()
    embed = want.model.embed_tokens.weight.detach().numpy()
    x = state_of(model)["model.embed_tokens.weight"]
    assert 0 < np.abs(embed - x).max() <= np.abs(x).max() / 15  # Q5_0's values, not the floats
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4)


def pack_k_quant(qtype, rows: int, cols: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random K-quant blocks as bytes [rows, cols/256 * type_size] and the values they stand for.

    Layouts (ggml-common.h): Q4_K = d, dmin (f16), 12 bytes of 6-bit (scale, min) for 8 sub-blocks
    of 32, 128 bytes of nibbles (bytes 32c..32c+31: low nibble sub-block 2c, high nibble 2c+1).
    Q5_K = the same plus 32 bytes qh before the nibbles, bit b of qh[l] the 5th bit of element
    32b + l. Q6_K = 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16), d.
    """
    n = rows * cols // 256
    u8 = np.uint8
    if qtype == Q.Q6_K:
        q = rng.integers(0, 64, (n, 256))
        scales = rng.integers(-128, 128, (n, 16)).astype(np.int8)
        d = rng.uniform(1e-4, 1e-3, (n, 1)).astype(np.float16)
        ql, qh = np.zeros((n, 128), u8), np.zeros((n, 64), u8)
        for half in range(2):
            for t in range(4):  # element 128*half + 32t + l
                part = q[:, 128 * half + 32 * t: 128 * half + 32 * t + 32]
                lo = slice(64 * half + 32 * (t % 2), 64 * half + 32 * (t % 2) + 32)
                ql[:, lo] |= ((part & 15) << (4 * (t // 2))).astype(u8)
                qh[:, 32 * half: 32 * half + 32] |= ((part >> 4) << (2 * t)).astype(u8)
        blocks = np.concatenate([ql, qh, scales.view(u8), d.view(u8)], axis=1)
        vals = (d.astype(np.float32) * scales.astype(np.float32)).repeat(16, axis=1) * (q - 32)
        return blocks.reshape(rows, -1), vals.astype(np.float32).reshape(rows, cols)
    bits = 4 if qtype == Q.Q4_K else 5
    q = rng.integers(0, 1 << bits, (n, 256))
    sc, mn = rng.integers(0, 64, (n, 8)), rng.integers(0, 64, (n, 8))
    d = rng.uniform(1e-4, 1e-3, (n, 1)).astype(np.float16)
    dmin = rng.uniform(1e-4, 1e-3, (n, 1)).astype(np.float16)
    packed = np.zeros((n, 12), u8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = np.zeros((n, 128), u8)
    for c in range(4):
        qs[:, 32 * c: 32 * c + 32] = (q[:, 64 * c: 64 * c + 32] & 15) | (
            (q[:, 64 * c + 32: 64 * c + 64] & 15) << 4)
    parts = [d.view(u8), dmin.view(u8), packed]
    if bits == 5:
        qh = np.zeros((n, 32), u8)
        for b in range(8):
            qh |= ((q[:, 32 * b: 32 * b + 32] >> 4) << b).astype(u8)
        parts.append(qh)
    blocks = np.concatenate(parts + [qs], axis=1)
    scale = (d.astype(np.float32) * sc.astype(np.float32)).repeat(32, axis=1)
    offset = (dmin.astype(np.float32) * mn.astype(np.float32)).repeat(32, axis=1)
    vals = scale * q.astype(np.float32) - offset
    return blocks.reshape(rows, -1), vals.reshape(rows, cols)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_k_quant_gguf_tensors_dequantise_to_the_ggml_block_layout(tmp_path, qtype):
    model = tiny_hf_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    state = state_of(model)
    rng = np.random.default_rng(1)
    blocks = {}
    for name, a in state.items():  # every matrix llama.cpp does not permute
        if a.ndim == 2 and not re.search(r"\.(q|k)_proj\.", name):
            blocks[name], state[name] = pack_k_quant(qtype, *a.shape, rng)
            assert blocks[name].shape[1] == a.shape[1] // 256 * gguf.GGML_QUANT_SIZES[qtype][1]
    path = write_gguf(tmp_path / "k.gguf", "llama", model.config, state,
                      lambda name, a: (blocks[name], qtype) if name in blocks else None)
    src = read_gguf(path)
    assert len(blocks) == 7  # embed, lm_head, v, o, gate, up, down
    for name in blocks:
        got = src.tensors[name]
        assert got.dtype == np.float32 and got.shape == state[name].shape, name
        np.testing.assert_allclose(got, state[name], rtol=1e-6, atol=1e-9, err_msg=name)


def llama_cpp_rope_factors(theta: float, head_dim: int, s: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors for rope_type llama3, as written there."""
    import math

    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            low, high = s["low_freq_factor"], s["high_freq_factor"]
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, np.float32)


@pytest.mark.parametrize("head_dim, low, high, old", [(16, 1.0, 4.0, 8192), (128, 1.0, 4.0, 8192),
                                                      (128, 2.0, 8.0, 4096)])
def test_llama3_rope_freqs_map_back_to_the_same_inverse_frequencies(tmp_path, head_dim, low, high,
                                                                    old):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": old}
    model = tiny_hf_model("llama", hidden_size=2 * head_dim, head_dim=head_dim,
                          num_hidden_layers=1, max_position_embeddings=131072,
                          rope_scaling=scaling)
    factors = llama_cpp_rope_factors(5e5, head_dim, scaling)
    path = write_gguf(tmp_path / "r.gguf", "llama", model.config, state_of(model),
                      extra={"rope_freqs.weight": factors})
    src = read_gguf(path)
    assert "rope_freqs.weight" not in src.tensors
    assert src.config["rope_scaling"]["rope_type"] == "llama3"
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](model.config, "cpu")
    got, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config_of(src), "cpu")
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6)
    if (head_dim, low, high, old) == (128, 1.0, 4.0, 8192):
        assert (Model.from_hf_config(src.config).config.rope_scaling
                == LLAMA_PRESETS["llama3.1-8b"].rope_scaling)


# --- Hugging Face folders -------------------------------------------------------------------------

@pytest.mark.parametrize("arch, dtype, shard", [
    ("llama", torch.float32, None), ("qwen2", torch.float32, "20KB"), ("gpt2", torch.float32, None),
    ("llama", torch.bfloat16, "20KB"), ("qwen2", torch.float16, None),
    ("gpt2", torch.bfloat16, "bin")])
def test_hf_folder_reads_back_as_the_state_dict(tmp_path, arch, dtype, shard):
    model = tiny_hf_model(arch).to(dtype)
    want = model.state_dict()
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard in ("20KB",) else {}))
    if shard == "bin":  # the old format, with the tied head saved too
        os.remove(tmp_path / "model.safetensors")
        torch.save(want, tmp_path / "pytorch_model.bin")
    elif shard:
        assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    src = read_source(str(tmp_path))

    tied = {"lm_head.weight"} if model.config.tie_word_embeddings and shard != "bin" else set()
    assert set(src.tensors) == set(want) - tied
    np_dtype = {torch.float32: np.float32, torch.bfloat16: ml_dtypes.bfloat16,
                torch.float16: np.float16}[dtype]
    for name, a in src.tensors.items():
        assert a.dtype == np_dtype and a.shape == tuple(want[name].shape), name
        np.testing.assert_array_equal(a.astype(np.float32), want[name].float().numpy(), name)
    assert src.model_type == arch and src.gguf_path is None
    assert Model.from_hf_config(src.config) == Model.from_hf_config(model.config.to_dict())


def test_hf_folder_brings_tokenizer_files_and_chat_template(tmp_path):
    from tokenizers import Tokenizer, models

    tiny_hf_model("llama").save_pretrained(tmp_path)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")))
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path)
    src = read_hf_folder(str(tmp_path))
    assert "tokenizer.json" in src.tokenizer_files
    assert any(n in src.tokenizer_files for n in ("chat_template.jinja", "tokenizer_config.json"))
    for name, data in src.tokenizer_files.items():
        assert (tmp_path / name).read_bytes() == data


def test_gguf_file_reads_what_ggufs_own_reader_reads(tmp_path):
    """runner.checkpoints.gguf_file against gguf.GGUFReader: every metadata value type, a wider
    alignment, and tensors of float and quantised types, byte for byte."""
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    w.add_custom_alignment(64)
    for kind, value in [("uint8", 200), ("int8", -5), ("uint16", 60000), ("int16", -300),
                        ("uint32", 4_000_000_000), ("int32", -70000), ("float32", 1e-5),
                        ("uint64", 2**40 + 3), ("int64", -(2**40)), ("float64", 0.1),
                        ("bool", True), ("string", "héllo <|im_start|>")]:
        getattr(w, f"add_{kind}")(f"t.{kind}", value)
    w.add_array("t.strings", ["a", "", "Ġthe", "\u00e9\u4e2d"])
    w.add_array("t.ints", [3, -1, 7])
    w.add_array("t.floats", [0.5, -2.25])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 64)).astype(np.float32)
    for qtype in (Q.F32, Q.F16, Q.F64, Q.BF16, Q.Q8_0, Q.Q4_1):
        data, raw_dtype = stored_as(qtype, a, rng)
        w.add_tensor(f"x.{qtype.name}", data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, ref = GGUFFile(str(tmp_path / "m.gguf")), gguf.GGUFReader(str(tmp_path / "m.gguf"))
    fields = {k: f for k, f in ref.fields.items() if not k.startswith("GGUF.")}  # its header, as fields
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        want = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            want = float(str(np.float32(want)))
        assert ours.metadata[key] == want and type(ours.metadata[key]) is type(want), key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert t.shape == tuple(r.shape.tolist()) and t.tensor_type == r.tensor_type, t.name
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape, t.name
        assert t.data.tobytes() == r.data.tobytes(), t.name
    assert ours.metadata["general.alignment"] == 64


# --- errors ---------------------------------------------------------------------------------------

# A quantised type the installed gguf has no dequantiser for (0.19.0: Q8_1, Q8_K, Q1_0), or else
# I8 (an integer type, never dequantised).
GGUF_CANNOT_READ = next((t for t in Q if gguf.GGML_QUANT_SIZES[t][0] > 1
                         and not gguf_dequantises(t)), Q.I8)


def small_gguf(tmp_path, name="s.gguf", **kw) -> str:
    model = tiny_hf_model("llama", num_hidden_layers=1)
    return write_gguf(tmp_path / name, "llama", model.config, state_of(model), **kw)


def truncate(path, keep: float) -> str:
    os.truncate(path, int(os.path.getsize(path) * keep))
    return str(path)


def bad_sources(tmp_path) -> dict:
    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    st = tmp_path / "st"
    tiny_hf_model("llama").save_pretrained(st)
    truncate(st / "model.safetensors", 0.5)
    (tmp_path / "x.txt").write_text("hello")
    return {
        "missing": str(tmp_path / "nope"),
        "no config.json": str(tmp_path / "empty"),
        "no weights": str(tmp_path / "noweights"),
        "truncated safetensors": str(st),
        "truncated gguf tensors": truncate(small_gguf(tmp_path, "a.gguf"), 0.6),
        "truncated gguf header": truncate(small_gguf(tmp_path, "b.gguf"), 0.002),
        "not a model": str(tmp_path / "x.txt"),
        "unsupported quant": small_gguf(tmp_path, "c.gguf", types={
            "model.layers.0.mlp.up_proj.weight": GGUF_CANNOT_READ}),
        "unrecoverable rope_freqs": small_gguf(tmp_path, "d.gguf", extra={
            "rope_freqs.weight": np.linspace(3, 1, 8).astype(np.float32)}),
    }


@pytest.mark.parametrize("case", [
    "missing", "no config.json", "no weights", "truncated safetensors", "truncated gguf tensors",
    "truncated gguf header", "not a model", "unsupported quant", "unrecoverable rope_freqs"])
def test_bad_sources_raise_source_error_naming_the_path(tmp_path, case):
    path = bad_sources(tmp_path)[case]
    with pytest.raises(SourceError, match=re.escape(path)) as e:
        read_source(path)
    assert "\n" not in str(e.value)


def test_a_gguf_type_gguf_cannot_dequantise_is_refused_naming_tensor_type_and_remedy(tmp_path):
    path = bad_sources(tmp_path)["unsupported quant"]
    with pytest.raises(SourceError) as e:
        read_source(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: tensor blk.0.ffn_up.weight is {GGUF_CANNOT_READ.name}, ")
    assert "cannot dequantise" in msg and "upgrade gguf" in msg and "llama-quantize" in msg
    assert "\n" not in msg


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SourceError, match="architecture 'falcon' is not supported"):
        read_source(str(tmp_path / "f.gguf"))
