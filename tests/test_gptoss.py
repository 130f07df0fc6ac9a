"""GPT-OSS against transformers' GptOssForCausalLM (eager attention): prompts longer than the
window, several experts, non-zero sinks; meshes that shard experts, heads and batch."""

import numpy as np
import pytest
import torch
import transformers

from models.policy import Policy
from runner.engine import Engine, Request, Scheduler, generate
from tests.conftest import MOE_MESHES, rules_for
from tests.forward import Rows, prompt_logits
from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf, to_podrun

MESH_NAMES = ["1dev", "data8", "data2_model4", *MOE_MESHES]


@pytest.fixture(scope="module")
def gptoss():
    m = tiny_hf("gptoss", seed=7)
    assert m.config.layer_types[0] == "sliding_attention" and m.config.sliding_window == 8
    assert float(m.model.layers[0].self_attn.sinks.detach().abs().min()) > 0
    return m


@pytest.mark.parametrize("mesh_name,fuse,scatter", [(m, False, False) for m in MESH_NAMES]
                         + [("1dev", True, False), ("data2_model4", True, False),
                            ("expert2_model2_data2", True, False), ("expert4_data2", False, True)])
def test_logits_match_transformers(gptoss, mesh_name, fuse, scatter, monkeypatch):
    """fuse: q/k/v as one product (models/fused.py). scatter: tokens reach the experts' buckets
    as scattered rows, as many tokens do, rather than through one-hot products."""
    from models import gptoss as module

    if scatter:
        monkeypatch.setattr(module, "ONE_HOT_DISPATCH", 0)
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules, fuse)
    tokens = np.random.RandomState(1).randint(0, VOCAB, (8, 30)).astype(np.int32)  # 30 > window 8
    logits = prompt_logits(model, params, rules, Policy(), tokens)
    np.testing.assert_allclose(np.stack(logits), hf_logits(gptoss, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dispatch", ["one_hot", "scatter"])
def test_moe_stays_exact_when_routing_overflows_the_capacity(mesh_rules, dispatch, monkeypatch):
    """A router bias that sends every token to experts 0 and 1: far above the mean load. Tokens
    reach the capacity buckets through one-hot products (few tokens, as in decode) or through a
    scatter of rows (many)."""
    from models import gptoss as module

    monkeypatch.setattr(module, "ONE_HOT_DISPATCH", 1 << 30 if dispatch == "one_hot" else 0)
    m = tiny_hf("gptoss", seed=8)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.router.bias[:2] += 50.0
    model, params = to_podrun(m, mesh_rules)
    tokens = np.random.RandomState(2).randint(0, VOCAB, (8, 20)).astype(np.int32)
    logits = prompt_logits(model, params, mesh_rules, Policy(), tokens)
    np.testing.assert_allclose(np.stack(logits), hf_logits(m, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("mesh_name", ["data8", "expert2_model2_data2", "heads_over_model_expert"])
def test_decode_past_the_window_matches_full_forward(gptoss, mesh_name):
    """Ragged prompts around the window size, in chunks of 6 over pages of 4, then decoded far past
    it: every prompt position's and every step's logits equal a full forward pass (q/k/v fused on
    the sharded meshes)."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules, fuse=mesh_name != "data8")
    rng = np.random.RandomState(3)
    B, P, steps = 8, 16, 20
    lengths = np.array([1, 5, 7, 8, 9, 12, 15, 16])
    seqs = rng.randint(0, VOCAB, (B, P + steps)).astype(np.int32)
    rows = Rows(model, params, rules, Policy(), B, P + steps)
    prompts = rows.prefill([seqs[b, :n] for b, n in enumerate(lengths)], chunk=6)
    got = [np.stack([p[-1] for p in prompts])]
    for i in range(steps):
        got.append(rows.step([seqs[b, n + i] for b, n in enumerate(lengths)]))
    for b, n in enumerate(lengths):
        ref = hf_logits(gptoss, seqs[b : b + 1, : n + steps])[0]
        np.testing.assert_allclose(prompts[b], ref[:n], atol=2e-4, rtol=1e-4)
        for i in range(steps + 1):
            np.testing.assert_allclose(got[i][b], ref[n - 1 + i], atol=2e-4, rtol=1e-4)


# (slow: expert4_data2 with whole prompts, which the chunked case below also reaches through the
# same experts; data x model, which test_end_to_end runs through runner.main with the expert axis;
# heads over model and expert, the chunked case's experts with heads split too)
@pytest.mark.parametrize("mesh_name,batch,chunk,page_size", [
    ("1dev", 1, 16, 4),
    pytest.param("expert4_data2", 4, 256, 16, marks=pytest.mark.slow),
    pytest.param("data2_model4", 4, 256, 16, marks=pytest.mark.slow),
    ("expert4_data2", 4, 16, 4),
    pytest.param("heads_over_model_expert", 4, 16, 16, marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(gptoss, mesh_name, batch, chunk, page_size):
    """Six requests of different lengths through `batch` rows, so most enter a row mid-run, onto
    pages that rows which held other requests gave back; prompts longer than `chunk` computed a
    chunk a step beside the decoding rows, the windowed layers giving back pages as they pass."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules)
    engine = Engine(model, params, rules, Policy(), batch_size=batch, max_prompt_len=32,
                    max_new_tokens=32, page_size=page_size, chunk=chunk)
    rng = np.random.RandomState(4)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 20, 11, 30, 7, 25)]
    lengths = (32, 9, 20, 32, 14, 26)
    got = generate(engine, [Request(p, n) for p, n in zip(prompts, lengths)])
    for c, p, n in zip(got, prompts, lengths):
        assert c.token_ids == hf_greedy(gptoss, p, 32)[:n]


# Pages of 16 behind a 40-token prefix: each prompt after the first takes the prefix's 2 full pages
# (32 tokens) from the pool, the windowed layers' among them, and computes the rest.
# (slow: the sharded, scanned case, whose scanned pools test_engine's cases also run)
@pytest.mark.parametrize("mesh_name,policy", [
    ("1dev", Policy()),
    pytest.param("data2_model4", Policy(scan_layers=True), marks=pytest.mark.slow)])
def test_prompts_that_share_a_prefix_compute_it_once_through_the_windowed_layers(
        gptoss, mesh_name, policy):
    """Prompts behind one 40-token prefix, with a window of 8 on half the layers: what follows the
    shared pages attends to the windowed layers' pages of the prefix that its window reaches.
    Greedy tokens equal transformers' for each prompt alone; the prefix is computed once a group."""
    rng = np.random.RandomState(13)
    prefix = tuple(int(t) for t in rng.randint(0, VOCAB, 40))
    prompts = [prefix + tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 9, 1, 20, 6)]
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules, policy=policy)
    engine = Engine(model, params, rules, policy, batch_size=4, max_prompt_len=64, max_new_tokens=8,
                    page_size=16)
    ended = []
    stats = Scheduler(engine, [Request(p, 8) for p in prompts]).run(ended.extend)
    got = {i: cs[0].token_ids for i, cs in ended}
    assert [got[i] for i in range(len(prompts))] == [hf_greedy(gptoss, p, 8) for p in prompts]
    groups = rules.shards("batch")
    assert stats.prompt_tokens - stats.prompt_tokens_computed == 32 * (len(prompts) - groups)


def test_an_mxfp4_checkpoint_converts_and_generates_as_transformers_does(tmp_path):
    """A quantised HF folder (MXFP4 experts, as released) through runner.tools.convert and runner.main;
    the reference is transformers loading the same folder (dequantising on CPU), run in f32."""
    from tests.test_end_to_end import podrun, read_jsonl, write_jsonl
    from tests.test_sources_gptoss import tiny_gpt_oss, write_quantised_folder

    (tmp_path / "hf").mkdir()
    write_quantised_folder(tiny_gpt_oss(), str(tmp_path / "hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.bfloat16, attn_implementation="eager").float().eval()
    ref.generation_config.eos_token_id = None
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8], [7]]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": p} for p in prompts])
    podrun("runner.main", f"--config=configs/cpu.py:{tmp_path / 'ck'}:mesh8", f"--config.io.input={inp}",
           f"--config.io.output={tmp_path / 'out.jsonl'}", "--config.generation.max_new_tokens=16",
           "--config.generation.max_prompt_len=16", "--config.mesh.expert=2", "--config.mesh.model=2",
           f"--config.compilation_cache.dir={tmp_path / 'xla'}")
    for r, p in zip(read_jsonl(tmp_path / "out.jsonl"), prompts):
        assert r["token_ids"] == hf_greedy(ref, p, 16)
