"""Scan over layers (programs.scan_layers): stacked weights and caches, against transformers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import scan
from models.decoder import Output
from models.policy import Policy
from runner.engine import Engine, Request, generate
from tests.conftest import rules_for
from tests.forward import prompt_logits
from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf, to_podrun


def test_the_period_is_the_shortest_repeat_of_the_windows_that_divides_the_depth():
    assert scan.period((None,) * 6) == 1
    assert scan.period((128, None) * 12) == 2  # GPT-OSS as released
    assert scan.period((8, None, 8)) == 3  # no shorter repeat divides 3 layers
    assert scan.period((8, 8, None, 8, 8, None)) == 3


CASES = [  # kind, config overrides, mesh, prompt chunk, fuse
    ("llama", {}, "data2_model4", 256, False),
    ("qwen2", {}, "data8", 256, True),
    ("gpt2", {}, "1dev", 16, False),
    ("gptoss", {"num_hidden_layers": 4}, "expert2_model2_data2", 256, False),  # 2 periods of 2
    pytest.param("gptoss", {"num_hidden_layers": 4}, "expert4_data2", 16, True, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,overrides,mesh,chunk,fuse", CASES,
                         ids=[f"{c[0]}-{c[2]}-chunk{c[3]}{'-fused' if c[4] else ''}"
                              for c in (getattr(c, "values", c) for c in CASES)])
def test_scanned_generation_matches_transformers(kind, overrides, mesh, chunk, fuse):
    """Ragged prompts computed (whole, or in chunks of 16), then 24 greedy tokens decoded past
    GPT-OSS's window: token for token what transformers generates; the weights and the page pools
    really are stacked."""
    rules = rules_for(mesh)
    m = tiny_hf(kind, seed=7, **overrides)
    policy = Policy(scan_layers=True, fuse_projections=fuse)
    model, params = to_podrun(m, rules, policy=policy)
    depth = model.num_layers // model.scan_period
    assert "layers" not in params and len(params["layer_stack"]) == model.scan_period
    assert all(x.shape[0] == depth for x in jax.tree.leaves(params["layer_stack"]))
    engine = Engine(model, params, rules, policy, batch_size=2, max_prompt_len=32, max_new_tokens=24,
                    page_size=4, chunk=chunk)
    L, windows = engine.layout, model.module.cache_spec(model.config)[0]
    assert ([x.shape[1] for x in engine.cache.k]
            == [depth * (L.window_pages if w else L.pages) for w in windows[:model.scan_period]])
    rng = np.random.RandomState(4)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 20, 11, 30)]
    lengths = (24, 7, 24, 15)  # rows free at different times: the later prompts enter mid-run
    got = generate(engine, [Request(p, n) for p, n in zip(prompts, lengths)])
    for c, p, n in zip(got, prompts, lengths):
        assert c.token_ids == hf_greedy(m, p, 24)[:n]


def test_scanned_prefill_logits_match_transformers():
    """Every position's logits of a scanned forward pass over empty stacked pools."""
    rules = rules_for("data2_model4")
    m = tiny_hf("llama")
    policy = Policy(scan_layers=True)
    model, params = to_podrun(m, rules, policy=policy)
    tokens = np.random.RandomState(1).randint(0, VOCAB, (8, 40)).astype(np.int32)
    logits = prompt_logits(model, params, rules, policy, tokens)
    np.testing.assert_allclose(np.stack(logits), hf_logits(m, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_scanned_paged_forward_logits_match_transformers(kind):
    """A prompt of 12 tokens through stacked page pools (pages of 4, in table order; GPT-OSS: 4
    layers, window 8, 2 deep) in two passes, 8 tokens then 4 that read the first's pages of every
    layer: every position's logits."""
    rules = rules_for("1dev")
    m = tiny_hf(kind, seed=5, **({"num_hidden_layers": 4} if kind == "gptoss" else {}))
    policy = Policy(scan_layers=True).on(rules)
    model, params = to_podrun(m, rules, policy=policy)
    pool, tables = model.paged_cache(1, 1, 32, rules, policy, page_size=4)  # [G, R, M]: one sequence
    assert [x.shape[1] for x in pool.k] == [16] * model.scan_period  # 8 pages, 2 layers deep
    tokens = np.random.RandomState(2).randint(0, VOCAB, (1, 12)).astype(np.int32)

    @functools.partial(jax.jit, static_argnames="output")
    def run(params, pool, tokens, start, output):
        T = tokens.shape[1]
        cache = pool.at(tables, tables, jnp.zeros((1, T), jnp.int32))
        positions = start + jnp.arange(T, dtype=jnp.int32)[None]
        logits, cache = model.forward(params, tokens, positions, cache, rules, policy, output)
        return logits, cache.pool()

    want = hf_logits(m, tokens)
    first, pool = run(params, pool, tokens[:, :8], 0, Output.LOGITS)
    np.testing.assert_allclose(np.asarray(first), want[:, :8], atol=2e-4, rtol=1e-4)
    rest, _ = run(params, pool, tokens[:, 8:], 8, Output.LOGITS)
    np.testing.assert_allclose(np.asarray(rest), want[:, 8:], atol=2e-4, rtol=1e-4)
