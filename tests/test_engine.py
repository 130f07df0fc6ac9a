"""The generation engine: greedy tokens against transformers, meshes, compile counts, sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.policy import Policy
from runner.engine import Engine, Request, generate
from runner.engine.engine import sample
from tests.conftest import rules_for
from tests.reference import VOCAB, hf_greedy, tiny_hf, to_podrun

STEPS = 32


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama", seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(4)
    return [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (5, 23, 2, 40, 11)]


@pytest.fixture(scope="module")
def references(llama, prompts):
    return [hf_greedy(llama, p, STEPS) for p in prompts]


def make_engine(m, mesh_name, policy=None, **kw):
    rules = rules_for(mesh_name)
    model, params = to_podrun(m, rules, policy=policy)
    args = dict(batch_size=4, max_prompt_len=48, max_new_tokens=STEPS, steps_per_dispatch=8)
    args.update(kw)
    return Engine(model, params, rules, policy or Policy(), **args)


@pytest.mark.parametrize("mesh_name,donate", [("1dev", True), pytest.param("data8", True, marks=pytest.mark.slow),
                                              ("data2_model4", True),
                                              pytest.param("data2_model4", False, marks=pytest.mark.slow)])
def test_greedy_batches_match_transformers(llama, prompts, references, mesh_name, donate):
    """Ragged prompts, batches that do not fill (or divide over) the data axis, 32 greedy steps;
    with the cache donated to each call (updated in place) or not (a new cache per call)."""
    engine = make_engine(llama, mesh_name, Policy(donate_cache=donate), batch_size=3)
    got = []
    for i in range(0, len(prompts), engine.batch_size):
        got += generate(engine, [Request(p, STEPS) for p in prompts[i : i + engine.batch_size]])
    for c, ref in zip(got, references):
        assert c.token_ids == ref
        assert c.finish_reason == "length"


@pytest.mark.parametrize("mesh_name,batch,rows", [("1dev", 3, 1), ("data2_model4", 4, 2)])
def test_prefill_a_few_rows_at_a_time_matches_transformers(llama, prompts, references, mesh_name,
                                                             batch, rows):
    engine = make_engine(llama, mesh_name, batch_size=batch, prefill_rows=rows)
    assert engine.batch_size // engine.prefill_rows > 1  # really in several groups
    got = generate(engine, [Request(p, STEPS) for p in prompts[:batch]])
    assert [c.token_ids for c in got] == references[:batch]


def test_stop_ids_end_a_row_and_finished_rows_produce_nothing(llama, prompts, references):
    engine = make_engine(llama, "data8")
    stop = references[1][6]  # row 1 stops at its 7th token (or earlier if that id came sooner)
    got = generate(engine, [Request(p, STEPS) for p in prompts[:4]], stop_ids=[stop])
    for c, ref in zip(got, references):
        if stop in ref:
            cut = ref.index(stop) + 1
            assert c.token_ids == ref[:cut] and c.finish_reason == "stop"
        else:
            assert c.token_ids == ref and c.finish_reason == "length"
    short = generate(engine, [Request(prompts[0], 5), Request(prompts[1], 9)])
    assert [c.token_ids for c in short] == [references[0][:5], references[1][:9]]


def test_host_stop_check_ends_a_row(llama, prompts, references):
    engine = make_engine(llama, "data8")
    got = generate(engine, [Request(prompts[0], STEPS)], stop_check=lambda b, ids: len(ids) >= 3)
    assert got[0].token_ids[:3] == references[0][:3] and got[0].finish_reason == "stop"
    assert len(got[0].token_ids) <= 3 + engine.steps


def test_rows_decode_only_the_calls_they_need(llama, prompts, references):
    """Rows of 5, 17 and 9 tokens (the first from prefill, 8 per call) take 2 decode calls, none
    wasted, with or without a stop id that never comes; the tokens are transformers'."""
    engine = make_engine(llama, "data8")
    assert engine.steps == 8
    calls = []
    decode = engine._decode
    engine._decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    lengths = (5, 17, 9)
    for stop_ids in ((), (VOCAB + 1,)):
        calls.clear()
        got = generate(engine, [Request(p, n) for p, n in zip(prompts, lengths)], stop_ids=stop_ids)
        assert [c.token_ids for c in got] == [ref[:n] for ref, n in zip(references, lengths)]
        assert len(calls) == 2


@pytest.mark.parametrize("mesh_name", ["1dev", pytest.param("data2_model4", marks=pytest.mark.slow)])
def test_requests_inserted_mid_run_match_transformers(llama, prompts, references, mesh_name):
    """Ten requests of different lengths through 2 rows: each enters a row another request has
    just left, beside a row in mid-decode, and its greedy tokens are transformers' for it alone;
    a request ending at its first token (max_tokens 1) frees its row at once. Rows are refilled
    as they free: fewer decode calls than batches of 2 run to their longest request would take."""
    engine = make_engine(llama, mesh_name, batch_size=2)
    order = [0, 1, 2, 3, 4, 3, 2, 1, 0, 4]
    lengths = [3, 30, 1, 12, 25, 7, 20, 4, 16, 9]
    calls = []
    decode = engine._decode
    engine._decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    got = generate(engine, [Request(prompts[i], n) for i, n in zip(order, lengths)])
    assert [c.token_ids for c in got] == [references[i][:n] for i, n in zip(order, lengths)]
    assert all(c.finish_reason == "length" for c in got)
    static = sum(-(-(max(lengths[i : i + 2]) - 1) // engine.steps) for i in range(0, 10, 2))
    assert len(calls) < static


@pytest.mark.parametrize("mesh_name,smallest", [("1dev", 1),
                                                pytest.param("data2_model4", 2, marks=pytest.mark.slow)])
def test_the_last_requests_gathered_into_fewer_rows_match_transformers(llama, prompts, references,
                                                                        mesh_name, smallest):
    """Twelve requests of very different lengths through 8 rows: once none waits and at most half
    the rows are live, the live ones move into a cache of 4 rows, then 2 (then 1), each row's
    tokens still transformers' for its request alone, a seeded sampled row's still its own; the
    decode steps then run with fewer rows. The engine takes a whole batch again afterwards."""
    engine = make_engine(llama, mesh_name, batch_size=8, smallest_tail=smallest)
    assert engine.tail_sizes == (4, 2, 1)[: 3 - smallest + 1]
    order = [0, 1, 2, 3, 4, 3, 2, 1, 0, 4, 1, 3]
    lengths = [3, 30, 1, 12, 25, 7, 20, 4, 16, 9, 32, 2]
    sampled = Request(prompts[2], 24, temperature=1.0, seed=9)
    alone = generate(make_engine(llama, mesh_name, batch_size=2), [sampled])[0].token_ids
    rows = []
    decode = engine._decode
    engine._decode = lambda w, cache, state, *a, **k: rows.append(state.done.shape[0]) or decode(
        w, cache, state, *a, **k)
    from runner.engine import Scheduler

    requests = [Request(prompts[i], n) for i, n in zip(order, lengths)] + [sampled]
    got: dict[int, object] = {}
    stats = Scheduler(engine, requests).run(lambda ended: got.update((i, cs[0]) for i, cs in ended))
    assert [got[k].token_ids for k in range(len(order))] == [references[i][:n] for i, n in zip(order, lengths)]
    assert got[len(order)].token_ids == alone
    assert rows[0] == 8 and rows[-1] <= 2 and rows == sorted(rows, reverse=True) and stats.shrinks >= 2
    assert stats.row_steps == engine.steps * sum(rows)
    assert engine.rows < 8
    rows.clear()
    again = generate(engine, [Request(p, 5) for p in prompts] * 2)  # a whole batch again
    assert rows[0] == 8 and [c.token_ids for c in again] == [r[:5] for r in references] * 2


def test_a_seeded_request_samples_the_same_tokens_wherever_it_runs(llama, prompts):
    """A request with a seed draws the same tokens alone, beside others, or entering a row
    mid-run; another seed draws others."""
    engine = make_engine(llama, "1dev", batch_size=2)
    target = Request(prompts[1], 20, temperature=1.0, top_p=0.95, seed=42)
    alone = generate(engine, [target])[0].token_ids
    others = [Request(p, n, temperature=0.8, seed=i) for i, (p, n) in
              enumerate(zip(prompts, (6, 11, 3, 17, 9)))]
    mixed = generate(engine, others[:3] + [target] + others[3:])
    assert mixed[3].token_ids == alone
    assert generate(engine, [dataclasses.replace(target, seed=43)])[0].token_ids != alone


def test_one_compilation_per_insert_shape_and_one_decode_step(llama, prompts):
    """Inserts compile once per (rows, bucket) they meet and decode once; a second pass over the
    same requests compiles nothing."""
    engine = make_engine(llama, "data2_model4", batch_size=2)
    assert engine.insert_sizes == (1, 2)
    compiles, shapes = [], set()
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_a, **_k: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None)
    insert = engine._insert
    engine._insert = lambda w, c, s, p, *a, **k: shapes.add(p.tokens.shape) or insert(w, c, s, p, *a, **k)
    requests = [Request(p, n) for p, n in zip(prompts, (12, 3, 12, 5, 9))]
    generate(engine, requests)
    first_pass = len(compiles)
    compiles.clear()
    generate(engine, requests)
    assert insert._cache_size() == len(shapes) >= 3 and {p for _, p in shapes} == {16, 32, 48}
    assert engine._decode._cache_size() == 1
    assert first_pass >= 4 and compiles == []


def test_same_seed_same_output_and_seeds_differ(llama, prompts):
    engine = make_engine(llama, "data8")

    def run(seed):
        reqs = [Request(p, 16, temperature=1.0, top_p=0.95, seed=seed + i) for i, p in enumerate(prompts[:3])]
        return [c.token_ids for c in generate(engine, reqs)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy(llama, prompts, references):
    engine = make_engine(llama, "data8")
    got = generate(engine, [Request(p, STEPS, temperature=0.9, top_k=1, seed=5) for p in prompts[:4]])
    assert [c.token_ids for c in got] == references[:4]


def test_sampling_keeps_to_the_nucleus_and_top_k():
    """Against numpy: draws only from the smallest set of tokens whose mass reaches top_p."""
    rng = np.random.RandomState(0)
    logits = rng.randn(4, 50).astype(np.float32) * 3
    temperature = np.array([1.0, 0.5, 1.0, 0.0], np.float32)
    top_p = np.array([0.6, 0.9, 1.0, 1.0], np.float32)
    top_k = np.array([0, 0, 5, 0], np.int32)
    seeds = np.arange(400 * 4, dtype=np.uint32).reshape(400, 4)
    draws = jax.jit(jax.vmap(lambda s: sample(logits, s, np.zeros(4, np.int32), temperature, top_k, top_p)))(seeds)
    draws = np.asarray(draws)
    for b in range(3):
        z = logits[b] / temperature[b]
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        if top_k[b]:
            allowed = set(order[: top_k[b]])
        else:
            n = int(np.searchsorted(np.cumsum(p[order]), top_p[b]) + 1)
            allowed = set(order[:n])
        assert set(draws[:, b]) <= allowed
        assert len(set(draws[:, b])) > 1
    assert set(draws[:, 3]) == {int(np.argmax(logits[3]))}


def test_sampling_draws_the_nucleus_distribution_whichever_way_a_row_goes():
    """A 3000-token vocabulary: rows whose nucleus lies among the top candidates and a flat row
    whose nucleus does not (sampled over the whole vocabulary). Over 2000 seeds each peaked row's
    draws follow numpy's nucleus probabilities (top_p, top_k, temperature), and every row draws
    the same tokens beside the flat row as alone: a row's way depends on its own logits."""
    from runner.engine.sampling import CANDIDATES, _candidates, _Logits

    rng = np.random.default_rng(1)
    V, n = 3000, 2000
    logits = (rng.standard_normal((4, V)) * np.array([[8.0], [6.0], [7.0], [0.1]])).astype(np.float32)
    temperature = np.array([1.0, 0.7, 1.3, 1.0], np.float32)
    top_p = np.array([0.9, 0.95, 1.0, 0.9], np.float32)
    top_k = np.array([0, 0, 20, 0], np.int32)
    fits = np.asarray(_candidates(_Logits(logits, temperature[:, None]), top_k, top_p).fits)
    assert fits.tolist() == [True, True, True, False]  # the flat row's nucleus: ~2700 tokens
    draw = jax.jit(jax.vmap(lambda s, x, t, k, p: sample(x, s, np.zeros(len(x), np.int32), t, k, p),
                            in_axes=(0, None, None, None, None)))
    seeds = np.arange(n, dtype=np.uint32)[:, None] + np.zeros((1, 4), np.uint32)
    together = np.asarray(draw(seeds, logits, temperature, top_k, top_p))
    alone = np.asarray(draw(seeds[:, :3], logits[:3], temperature[:3], top_k[:3], top_p[:3]))
    np.testing.assert_array_equal(together[:, :3], alone)
    for b in range(3):
        z = logits[b].astype(np.float64) / temperature[b]
        if top_k[b]:
            z = np.where(z >= np.sort(z)[::-1][top_k[b] - 1], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        kept = order[: int(np.searchsorted(np.cumsum(p[order]), top_p[b]) + 1)]
        assert len(kept) < CANDIDATES
        want = np.zeros(V)
        want[kept] = p[kept] / p[kept].sum()
        got = np.bincount(together[:, b], minlength=V) / n
        assert set(np.flatnonzero(got)) <= set(kept)
        assert np.abs(got - want).sum() / 2 < 0.06  # total variation; ~0.02 expected at n=2000
    assert len(set(together[:, 3])) > 1000  # the flat row really samples the whole vocabulary


def _nucleus_reference(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Which logits z [V] (float32, temperature-scaled) top_k then top_p keep, in float64 numpy:
    ties to the k-th largest and to the smallest in the nucleus kept."""
    z = z.astype(np.float64)
    if 0 < top_k < len(z):
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    if top_p >= 1:
        return np.isfinite(z)
    p = np.exp(z - z.max())
    p /= p.sum()
    values = np.unique(z[np.isfinite(z)])[::-1]
    smallest = values[0]
    for v in values:  # grow the nucleus value by value while the mass above v is short
        if p[z > v].sum() >= top_p:
            break
        smallest = v
    return z >= smallest


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_way_a_row_draws_is_gumbel_max_over_its_nucleus(dtype):
    """Each row's token is exactly the Gumbel-max over numpy's nucleus, its noise jax.random's
    uniform of the row's key folded with its count then each token id: rows without filters
    (top_k 0 or V, top_p 1), nuclei among the candidates (peaked, top_k 20), a flat nucleus of
    ~2700 tokens, top_k past the candidates (alone and under top_p), and a greedy row; in float32
    and in bfloat16 (the logits TPU decoding samples from), and the same tokens for a row alone."""
    from runner.engine.sampling import CANDIDATES

    rng = np.random.default_rng(7)
    V, n = 3000, 24
    spread = np.array([3, 5, 8, 7, 0.1, 2, 0.5, 3], np.float32)[:, None]
    logits = jnp.asarray(rng.standard_normal((8, V)) * spread, dtype)
    temperature = np.array([1.0, 0.8, 1.0, 1.3, 1.0, 0.9, 1.0, 0.0], np.float32)
    top_k = np.array([0, V, 0, 20, 0, 500, 300, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 1.0, 0.9, 0.8, 1.0, 1.0], np.float32)
    counts = np.arange(8, dtype=np.int32) * 3
    seeds = rng.integers(0, 2**32, (n, 8), dtype=np.uint32)
    draw = jax.jit(jax.vmap(lambda s, x, c, t, k, p: sample(x, s, c, t, k, p),
                            in_axes=(0, None, None, None, None, None)))
    got = np.asarray(draw(seeds, logits, counts, temperature, top_k, top_p))
    z = np.asarray(logits.astype(jnp.float32)) / np.maximum(temperature, 1e-6)[:, None]
    nuclei = [_nucleus_reference(z[b], top_k[b], top_p[b]) for b in range(7)]
    assert [int(m.sum()) for m in nuclei][:2] == [V, V] and nuclei[4].sum() > 2 * CANDIDATES
    assert 1 < nuclei[2].sum() < CANDIDATES and nuclei[3].sum() == 20
    assert CANDIDATES < nuclei[5].sum() < 500 and nuclei[6].sum() >= 300  # bfloat16: ties

    def noise(seed, count):  # [V]: each token's Gumbel noise under the row's key
        key = jax.random.fold_in(jax.random.key(seed), count)
        u = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (), jnp.float32,
                                                  jnp.finfo(jnp.float32).tiny, 1.0))(jnp.arange(V))
        return np.asarray(-jnp.log(-jnp.log(u)))

    for i in range(n):
        for b in range(7):
            want = np.argmax(np.where(nuclei[b], z[b] + noise(seeds[i, b], counts[b]), -np.inf))
            assert got[i, b] == want, (i, b)
    assert (got[:, 7] == np.argmax(np.asarray(logits[7]))).all()
    alone = np.asarray(draw(seeds[:, 4:7], logits[4:7], counts[4:7], temperature[4:7], top_k[4:7],
                            top_p[4:7]))
    np.testing.assert_array_equal(alone, got[:, 4:7])


def test_n_samples_share_one_prefill_and_are_independent_draws(llama):
    """n samples of a request come from one prefill: 8 samples in 8 free rows compute the prompt
    once; 11 samples in 4 rows run in turns (three prefills). Over 96 requests of 8 samples the
    first tokens follow transformers' softmax of the prompt's logits (chi-square), and two
    samples of one request are equal no more often than two independent draws (sum of p^2)."""
    from scipy import stats

    from runner.engine import Scheduler
    from tests.reference import hf_logits

    prompt = tuple(int(t) for t in np.random.RandomState(9).randint(0, VOCAB, 20))
    engine = make_engine(llama, "1dev", batch_size=8)
    ended = []
    one = Scheduler(engine, [Request(prompt, 3, temperature=1.0, seed=5, n=8)]).run(ended.extend)
    assert (one.prompt_tokens_computed, one.prompt_tokens) == (len(prompt), 8 * len(prompt))
    assert len(ended[0][1]) == 8 and len({tuple(c.token_ids) for c in ended[0][1]}) > 1
    assert ended[0][1][0].token_ids == generate(engine, [Request(prompt, 3, 1.0, seed=5)])[0].token_ids

    small = make_engine(llama, "1dev", batch_size=4)
    turns = Scheduler(small, [Request(prompt, 2, temperature=1.0, n=11)]).run(lambda e: None)
    assert (turns.inserts, turns.prompt_tokens_computed) == (3, 3 * len(prompt))

    requests = [Request(prompt, 1, temperature=1.0, seed=s, n=8) for s in range(96)]
    draws = np.array([[c.token_ids[0] for c in cs] for cs in generate(engine, requests)])  # [96, 8]
    z = hf_logits(llama, [prompt])[0, -1].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    seen = np.bincount(draws.reshape(-1), minlength=VOCAB)
    common = p * draws.size >= 5  # chi-square's bins: the likely tokens, the rest as one
    observed = np.append(seen[common], seen[~common].sum())
    expected = np.append(p[common], p[~common].sum()) * draws.size
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8)]
    equal = sum(int(np.sum(draws[:, a] == draws[:, b])) for a, b in pairs)
    trials, q = len(pairs) * len(draws), float(np.sum(p**2))
    assert abs(equal - trials * q) < 4 * np.sqrt(trials * q * (1 - q)) * 3  # pairs share samples


@pytest.mark.parametrize("mesh_name,policy", [("1dev", Policy()),
                                              pytest.param("data2_model4", Policy(scan_layers=True),
                                                           marks=pytest.mark.slow)])
def test_prompts_that_share_a_prefix_compute_it_once_and_match_transformers(llama, mesh_name, policy):
    """Prompts behind one 40-token prefix (two blocks of 16 shared, the rest computed), and others
    in between: greedy tokens equal transformers' for each prompt alone, in any order; the prefix
    is computed for the first of them alone. A pool of two blocks evicts the least recently used
    and still answers right; a scored continuation shares only what lies before it."""
    from runner.engine import Scheduler
    from tests.reference import hf_logits

    rng = np.random.RandomState(12)
    prefix = tuple(int(t) for t in rng.randint(0, VOCAB, 40))
    other = tuple(int(t) for t in rng.randint(0, VOCAB, 35))
    prompts = [prefix + tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (3, 9, 1, 20, 6)]
    prompts.insert(2, other + (1, 2))
    prompts.insert(4, other + (3,))
    want = [hf_greedy(llama, p, 8) for p in prompts]
    for pool_tokens in (256, 32):
        engine = make_engine(llama, mesh_name, policy, batch_size=4, max_new_tokens=8,
                             max_prompt_len=64, prefix_tokens=pool_tokens, prefix_block=16)
        ended = []
        stats = Scheduler(engine, [Request(p, 8) for p in prompts]).run(ended.extend)
        got = {i: cs[0].token_ids for i, cs in ended}
        assert [got[i] for i in range(len(prompts))] == want
        assert stats.prompt_tokens == sum(map(len, prompts))
        if pool_tokens == 256:  # every prompt after the first of its prefix computes all but 32
            assert stats.prompt_tokens - stats.prompt_tokens_computed == 32 * 4 + 32
            # a continuation after 40 pooled tokens: 32 shared, its own log-probabilities computed
            scored = prompts[3]
            ended = []
            again = Scheduler(engine, [Request(scored, 0, prompt_logprobs=True,
                                               prompt_logprobs_from=len(prefix))]).run(ended.extend)
            assert again.prompt_tokens_computed == len(scored) - 32
            got = ended[0][1][0].prompt_logprobs  # for prompt tokens 1 .. len - 1
            z = hf_logits(llama, [scored])[0].astype(np.float64)
            logp = z - z.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            assert got[:32] == [None] * 32
            for j in range(len(prefix), len(scored)):
                assert abs(float(got[j - 1].logprob) - logp[j - 1, scored[j]]) < 1e-4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_and_top_p_keep_what_transformers_warpers_keep(seed):
    """The set `nucleus` keeps, against transformers' TopKLogitsWarper then TopPLogitsWarper on
    the same temperature-scaled logits (continuous values: no ties), over a 3000-token vocabulary
    with nuclei of 1 to ~2000 tokens."""
    import torch
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from runner.engine.engine import nucleus

    rng = np.random.default_rng(seed)
    B, V = 8, 3000
    scaled = (rng.standard_normal((B, V)) * rng.uniform(0.3, 6, (B, 1))).astype(np.float32)
    top_k = np.array([0, 0, 0, 1, 50, 700, 2999, 0], np.int32)
    top_p = np.array([0.5, 0.9, 0.99, 0.9, 0.8, 0.95, 1.0, 1.0], np.float32)
    got = np.isfinite(np.asarray(jax.jit(nucleus)(scaled, top_k, top_p)))
    for b in range(B):
        x = torch.from_numpy(scaled[b : b + 1].copy())
        if top_k[b]:
            x = TopKLogitsWarper(int(top_k[b]))(None, x)
        if top_p[b] < 1:
            x = TopPLogitsWarper(float(top_p[b]))(None, x)
        want = torch.isfinite(x)[0].numpy()
        assert (got[b] == want).all(), (b, got[b].sum(), want.sum())
    assert got.sum(axis=1).min() == 1 and got.sum(axis=1).max() > 1000


def test_top_k_and_top_p_keep_every_tie_of_the_last_kept_logit():
    """bf16-rounded logits (many equal values): numpy over the distinct values; top_k keeps every
    logit equal to the k-th largest, top_p every logit equal to the smallest in the nucleus."""
    from runner.engine.engine import nucleus

    rng = np.random.default_rng(3)
    B, V = 6, 4000
    scaled = np.asarray(jnp.asarray(rng.standard_normal((B, V)) * 2, jnp.bfloat16).astype(jnp.float32))
    top_k = np.array([0, 10, 300, 0, 1, 40], np.int32)
    top_p = np.array([0.7, 1.0, 0.6, 0.0, 0.9, 0.999], np.float32)
    got = np.isfinite(np.asarray(jax.jit(nucleus)(scaled, top_k, top_p)))
    ties = 0
    for b in range(B):
        z = scaled[b].astype(np.float64)
        if top_k[b]:
            z = np.where(z >= np.sort(z)[::-1][top_k[b] - 1], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        values = np.unique(z[np.isfinite(z)])[::-1]  # distinct kept values, largest first
        smallest = values[0]
        for v in values:  # grow the nucleus value by value while the mass above v is short
            if p[z > v].sum() < top_p[b] or top_p[b] >= 1:
                smallest = v
            else:
                break
        want = z >= smallest
        assert (got[b] == want).all(), (b, got[b].sum(), want.sum())
        ties += int((z == smallest).sum() > 1)
    assert ties >= 2  # rows whose last kept logit is tied: the case at stake


def test_greedy_tokens_are_argmax_with_ties_to_the_lowest_index():
    from runner.engine.engine import greedy_tokens

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, 10] = np.inf
    np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(x))), np.argmax(x, axis=-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", pytest.param("gptoss", marks=pytest.mark.slow)])
def test_greedy_tokens_through_the_unembedding_screen_match_transformers(kind, prompts):
    """On one CPU device greedy tokens come through the int8 screen of the unembedding (Llama's
    lm_head [D, V], Qwen2's and GPT-2's tied embedding [V, D], GPT-OSS's lm_head [V, D]): the
    tokens are transformers' greedy ones (prefilled all at once or a row at a time), and a sampled
    row beside greedy ones changes none of theirs. kernels.greedy_screen=False, or several
    devices, make no screen."""
    m = tiny_hf(kind, seed=5)
    engine = make_engine(m, "1dev", batch_size=3)
    assert engine.greedy_screen is not None and engine.greedy_screen_bytes > 0
    lowered = engine.lower()
    assert all("podrun_greedy_screened" in f.as_text() for f in lowered.values()), list(lowered)
    rows = prompts[:3]
    want = [hf_greedy(m, p, STEPS) for p in rows]
    assert [c.token_ids for c in generate(engine, [Request(p, STEPS) for p in rows])] == want
    mixed = generate(engine, [Request(rows[0], STEPS), Request(rows[1], STEPS, temperature=1.0, seed=2),
                             Request(rows[2], STEPS)])
    assert mixed[0].token_ids == want[0] and mixed[2].token_ids == want[2]
    grouped = make_engine(m, "1dev", batch_size=3, prefill_rows=1)  # prefill a row at a time
    assert [c.token_ids for c in generate(grouped, [Request(p, STEPS) for p in rows])] == want
    assert make_engine(m, "1dev", Policy(greedy_screen=False), batch_size=3).greedy_screen is None
    assert make_engine(m, "data8", batch_size=8).greedy_screen is None
