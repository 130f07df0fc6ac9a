"""GPT-OSS against transformers' GptOssForCausalLM (eager attention): prompts longer than the
window, several experts, non-zero sinks; meshes that shard experts, heads and batch."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from models.decoder import Mode, Output
from models.policy import Policy
from runner.engine import Engine, Request, generate
from tests.conftest import MOE_MESHES, rules_for
from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf, to_podrun
from tests.test_models import full_forward

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
    logits, _ = full_forward(model, params, tokens, rules)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(gptoss, tokens), atol=2e-4, rtol=1e-4)


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
    logits, _ = full_forward(model, params, tokens, mesh_rules)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(m, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("mesh_name", ["data8", "expert2_model2_data2", "heads_over_model_expert"])
def test_decode_with_the_ring_cache_matches_full_forward(gptoss, mesh_name):
    """Ragged prompts around the window size, then decode far past it: the ring wraps several
    times and every step's logits equal a full forward pass (q/k/v fused on the sharded mesh)."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules, fuse=mesh_name != "data8")
    rng = np.random.RandomState(3)
    B, P, steps = 8, 16, 20
    lengths = np.array([1, 5, 7, 8, 9, 12, 15, 16])
    seqs = rng.randint(0, VOCAB, (B, P + steps)).astype(np.int32)
    cache = model.new_cache(B, P + steps, jnp.float32, rules)
    assert cache.k[0].shape[2] == 8 and cache.k[1].shape[2] == P + steps  # the window's ring vs full
    tokens = np.zeros((B, P), np.int32)
    positions = np.full((B, P), -1, np.int32)
    for b, n in enumerate(lengths):
        tokens[b, P - n:] = seqs[b, :n]
        positions[b, P - n:] = np.arange(n)
    import jax
    prefill = jax.jit(lambda p, t, pos, c: model.forward(p, t, pos, c, rules, Policy(), Mode.PREFILL, 0, Output.LAST_LOGITS))
    step = jax.jit(lambda p, t, pos, c, s: model.forward(p, t, pos, c, rules, Policy(), Mode.APPEND, s, Output.LAST_LOGITS))
    logits, cache = prefill(params, tokens, positions, cache)
    got = [np.asarray(logits)]
    for i in range(steps):
        tok = np.array([seqs[b, n + i] for b, n in enumerate(lengths)], np.int32)[:, None]
        logits, cache = step(params, tok, (lengths + i)[:, None].astype(np.int32), cache, np.int32(P + i))
        got.append(np.asarray(logits))
    for b, n in enumerate(lengths):
        ref = hf_logits(gptoss, seqs[b : b + 1, : n + steps])[0]
        for i in range(steps + 1):
            np.testing.assert_allclose(got[i][b], ref[n - 1 + i], atol=2e-4, rtol=1e-4)


# (slow: expert4_data2 prefilled all at once, which the grouped case below also reaches through the
# same experts; data x model, which test_end_to_end runs through runner.main with the expert axis;
# heads over model and expert, the grouped case's experts with heads split too)
@pytest.mark.parametrize("mesh_name,batch,rows", [("1dev", 1, 0),
                                                  pytest.param("expert4_data2", 4, 0, marks=pytest.mark.slow),
                                                  pytest.param("data2_model4", 4, 0, marks=pytest.mark.slow),
                                                  ("expert4_data2", 4, 2),
                                                  pytest.param("heads_over_model_expert", 4, 2,
                                                               marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(gptoss, mesh_name, batch, rows):
    """Six requests of different lengths through `batch` rows, so most enter a row mid-run, into
    the ring caches of rows that held other requests; rows > 0: at most that many prompts
    prefilled at once."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules)
    engine = Engine(model, params, rules, Policy(), batch_size=batch, max_prompt_len=32, max_new_tokens=32,
                    prefill_rows=rows)
    rng = np.random.RandomState(4)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 20, 11, 30, 7, 25)]
    lengths = (32, 9, 20, 32, 14, 26)
    got = generate(engine, [Request(p, n) for p, n in zip(prompts, lengths)])
    for c, p, n in zip(got, prompts, lengths):
        assert c.token_ids == hf_greedy(gptoss, p, 32)[:n]


# Prompt tokens served from the pool (buckets 16, 32, 64): block 12 shares 36 tokens of the
# 40-token prefix, but none with the 60-token prompt (after 36, 24 or 12 shared tokens the rest's
# bucket, 32, 64 or 64, overflows the 64 prompt columns a row keeps); block 16 shares 32 with
# every prompt after the first.
# (slow: the sharded, scanned case, whose pool and rings test_engine's Llama case also stacks)
@pytest.mark.parametrize("mesh_name,block,policy,shared", [
    ("1dev", 12, Policy(), 36 * 3),
    pytest.param("data2_model4", 16, Policy(scan_layers=True), 32 * 4, marks=pytest.mark.slow)])
def test_prompts_that_share_a_prefix_compute_it_once_through_the_windowed_layers(
        gptoss, mesh_name, block, policy, shared):
    """Prompts behind one 40-token prefix, with a window of 8 on half the layers: what follows the
    shared blocks attends to the pool's copy of the windowed layers' last columns before it, and
    the rows' rings take their last 8 columns. Greedy tokens equal transformers' for each prompt
    alone; the prefix is computed once."""
    from runner.engine import Scheduler

    rng = np.random.RandomState(13)
    prefix = tuple(int(t) for t in rng.randint(0, VOCAB, 40))
    prompts = [prefix + tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 9, 1, 20, 6)]
    rules = rules_for(mesh_name)
    model, params = to_podrun(gptoss, rules, policy=policy)
    engine = Engine(model, params, rules, policy, batch_size=4, max_prompt_len=64, max_new_tokens=8,
                    prefix_tokens=256, prefix_block=block)
    ended = []
    stats = Scheduler(engine, [Request(p, 8) for p in prompts]).run(ended.extend)
    got = {i: cs[0].token_ids for i, cs in ended}
    assert [got[i] for i in range(len(prompts))] == [hf_greedy(gptoss, p, 8) for p in prompts]
    assert stats.prompt_tokens - stats.prompt_tokens_computed == shared


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
