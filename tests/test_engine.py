"""The engine: the page pool on the host, then tokens against transformers through chunked
prompts, shared prefixes and preemption, on one device and over meshes; stops, seeds, samples,
log-probabilities and the greedy screen."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scipy import stats as scipy_stats

from models.policy import Policy
from runner.engine import Engine, Layout, Request, Scheduler
from runner.engine.engine import _same, chunk_buckets
from runner.engine.pages import HOLE, PagePool, Table, digests
from tests.conftest import rules_for
from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf, to_podrun

STEPS = 24

# --- the page pool (no model) -------------------------------------------------------------------


def test_pages_are_taken_and_given_back():
    pool = PagePool(6, 4)
    a, b = Table(pool), Table(pool)
    assert a.grow(9) and len(a.pages) == 3 and pool.available == 3
    assert b.grow(12) and pool.available == 0
    assert not a.grow(13) and len(a.pages) == 3  # nothing taken when the pool is short
    assert len(set(a.pages) | set(b.pages)) == 6
    b.release()
    assert pool.available == 3 and a.grow(20) and pool.available == 1
    a.release()
    assert pool.available == 6 and pool.in_use == 0
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([0])


def test_named_pages_are_shared_and_reclaimed_least_recent_first():
    pool = PagePool(4, 2)
    prompt = [5, 6, 7, 8, 9]
    names = digests(prompt, 2)
    assert len(names) == 2 and digests([5, 6, 7, 9], 2)[0] == names[0] != digests([5, 6, 7, 9], 2)[1]
    a = Table(pool)
    a.grow(len(prompt))
    a.length = len(prompt)
    a.name_full_pages(names)
    assert pool.matchable(names) == 2 and pool.matchable(digests([1, 2], 2)) == 0
    b = Table(pool, pool.match(names))  # a second sequence holds the same two pages
    assert b.pages == a.pages[:2] and b.length == 4 and pool.refs[a.pages[0]] == 2
    a.release()
    b.release()
    assert pool.available == 4 and pool.matchable(names) == 2  # idle, still matchable
    c = Table(pool)
    assert c.grow(4)  # the two free pages first: the named ones kept
    assert pool.matchable(names) == 2
    assert c.grow(6)  # then the least recently used named page, its name forgotten
    assert pool.matchable(names) == 0 and pool.available == 1


def test_a_window_table_gives_back_what_left_the_window_and_shares_past_holes():
    pool = PagePool(8, 4)
    a = Table(pool)
    a.grow(20)
    a.length = 20
    a.release_before(9)  # pages 0 and 1 hold positions 0..7, all before 9; page 2 holds 8..11
    assert a.pages[:2] == [HOLE, HOLE] and HOLE not in a.pages[2:] and pool.available == 5
    a.name_full_pages(digests(list(range(20)), 4))  # names pages 2..4, never a hole
    b = Table(pool, pool.match(digests(list(range(20)), 4)[3:5]), skipped=3)
    assert b.pages == [HOLE, HOLE, HOLE, a.pages[3], a.pages[4]] and b.length == 20
    a.release()
    b.release()
    assert pool.available == 8 and pool.in_use == 0


def test_chunk_buckets():
    assert chunk_buckets(256) == (16, 64, 256)
    assert chunk_buckets(32) == (32,)


@pytest.mark.parametrize("step_tokens", [16, 256])
def test_a_prompt_is_chunked_at_the_least_cost_in_slots_and_steps(step_tokens):
    """The chunks a prompt of n tokens is computed in cost the least slots plus step_tokens a step
    of any counts of 16-, 64- and 256-slot chunks that hold it: with steps that cost little its
    end is split into chunks it fills, with steps that cost much padded up to one chunk."""
    layout = Layout(groups=1, rows_per_group=4, max_prompt_len=1024, max_new_tokens=8, page_size=4,
                    pages=64, window=0, window_pages=0, steps=8, chunks=(16, 64, 256),
                    step_tokens=step_tokens, vocab_size=VOCAB)
    scheduler = Scheduler(Engineless(layout), [])
    for n in range(1, 700, 7):
        pieces, left = [], n
        while left > 0:
            pieces.append(scheduler._piece(left))
            left -= pieces[-1]
        best = min(16 * a + 64 * b + 256 * c + step_tokens * (a + b + c)
                   for a in range(n // 16 + 2) for b in range(n // 64 + 2) for c in range(n // 256 + 2)
                   if 16 * a + 64 * b + 256 * c >= n)
        assert sum(pieces) + step_tokens * len(pieces) == best, (n, pieces)
    assert scheduler._piece(150) == (16 if step_tokens == 16 else 256)


@dataclasses.dataclass
class Engineless:
    """A Runner's layout alone: what the scheduler plans with before any call."""

    layout: Layout


# --- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama", seed=3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(4)
    return [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (5, 23, 2, 40, 11, 17)]


@pytest.fixture(scope="module")
def references(llama, prompts):
    return [hf_greedy(llama, p, STEPS) for p in prompts]


def paged(m, mesh_name, policy=None, pages=0, **kw):
    """An engine over pages of 4 tokens; `pages` per group (0: room for every row's longest)."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(m, rules, policy=policy)
    args = dict(batch_size=4, max_prompt_len=48, max_new_tokens=STEPS, page_size=4,
                steps_per_dispatch=4, chunk=16)
    args.update(kw)
    return Engine(model, params, rules, policy or Policy(), pages=pages, **args)


def generate(engine, requests, **kw):
    """runner.engine.generate's completions, and the job's Stats."""
    out = [None] * len(requests)

    def done(ended):
        for i, samples in ended:
            out[i] = samples[0] if requests[i].n == 1 else samples

    stats = Scheduler(engine, requests, **kw).run(done)
    return out, stats


@pytest.mark.parametrize("mesh_name,kernels", [("1dev", True), pytest.param("1dev", False, marks=pytest.mark.slow),
                                               ("data2_model4", False)])
def test_greedy_through_chunked_prompts_matches_transformers(llama, prompts, references, mesh_name,
                                                             kernels):
    """Prompts of 2 to 40 tokens in chunks of up to 16, decoding rows in the same steps."""
    engine = paged(llama, mesh_name, Policy(kernels=kernels))
    requests = [Request(p, STEPS) for p in prompts]
    got, stats = generate(engine, requests)
    for c, ref in zip(got, references):
        assert c.token_ids == ref and c.finish_reason == "length"
    assert stats.programs <= 4 and stats.preemptions == 0
    # the programs compiled ahead, from the prompts alone, are the ones the job called
    assert {p.name for p in Scheduler(engine, requests).programs()} == engine.programs


def test_programs_compiled_before_the_weights_load_run_on_them(llama, prompts, references):
    """The job builds the engine on the weights' declaration (Model.abstract_params) and compiles
    its programs while the weights restore: the programs prepared then are the ones the calls run
    (nothing compiles again), and the tokens are transformers'."""
    rules = rules_for("1dev")
    model, params = to_podrun(llama, rules)
    args = dict(batch_size=4, max_prompt_len=48, max_new_tokens=STEPS, page_size=4,
                steps_per_dispatch=4, chunk=16)
    engine = Engine(model, model.abstract_params(rules, Policy()), rules, Policy(),
                         allocate=False, **args)
    requests = [Request(p, STEPS) for p in prompts]
    engine.prepare(Scheduler(engine, requests).programs())
    prepared = dict(engine._compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the declaration differing from the weights warns
        engine.load(params)
    got, _ = generate(engine, requests)
    assert [c.token_ids for c in got] == references
    assert all(engine._compiled[p] is f for p, f in prepared.items())
    assert {p.name for p in prepared} == engine.programs


@pytest.mark.parametrize("kind,mesh_name,policy", [
    ("llama", "1dev", Policy()),  # float32 projections in panels, the greedy screen
    ("llama", "1dev", Policy(quantize="int4")),
    ("llama", "1dev", Policy(quantize="int8", kv_cache="int8", kernels=False)),
    ("llama3", "data2_model4", Policy(quantize="int8")),
    ("gptoss", "expert2_model2_data2", Policy()),
    ("gptoss", "heads_over_model_expert", Policy(params="bfloat16", activations="bfloat16")),
    ("llama", "data2_model4", Policy(scan_layers=True)),  # stacked weights and pools
    ("gptoss", "expert2_model2_data2", Policy(scan_layers=True)),
])
def test_the_declared_weights_are_the_restored_ones(kind, mesh_name, policy):
    """Model.abstract_params, which the programs are lowered for before the weights load, gives
    the shapes, dtypes, shardings and layouts that the restored and prepared weights have."""
    rules = rules_for(mesh_name)
    model, params = to_podrun(tiny_hf(kind, seed=1), rules, prepare=False)
    # restored in policy.params' dtype (runner.checkpoints.store.restore), then prepared
    params = model.prepare(jax.tree.map(lambda x: x.astype(policy.params), params), rules, policy)
    args = dict(batch_size=4, max_prompt_len=48, max_new_tokens=8, page_size=4)
    declared = Engine(model, model.abstract_params(rules, policy), rules, policy,
                           allocate=False, **args)
    restored = Engine(model, params, rules, policy, **args)
    assert _same(declared._abstract, restored._abstract)
    leaves, tree = jax.tree.flatten(restored._abstract)  # and the check fails on one dtype
    leaves[0] = jax.ShapeDtypeStruct(leaves[0].shape, jnp.float16, sharding=leaves[0].sharding)
    assert not _same(declared._abstract, jax.tree.unflatten(tree, leaves))


def test_a_small_pool_preempts_and_gives_the_same_tokens(llama, prompts, references):
    engine = paged(llama, "1dev", pages=20)  # 80 slots: four rows of up to 64 tokens do not fit
    got, stats = generate(engine, [Request(p, STEPS) for p in prompts])
    assert stats.preemptions > 0
    assert [c.token_ids for c in got] == references


def test_a_decode_call_ends_when_a_row_ends_and_a_sample_waits(llama, prompts, references):
    """Six requests of 3 to 22 tokens over 4 rows, 4 steps a call: a row that ends mid-call ends
    the call while samples wait (its place is refilled at once), not once none waits; every
    request still gets transformers' tokens."""
    lengths = (3, 22, 5, 9, 14, 7)
    engine = paged(llama, "1dev")
    got, stats = generate(engine, [Request(p, n) for p, n in zip(prompts, lengths)])
    assert [c.token_ids for c in got] == [ref[:n] for ref, n in zip(references, lengths)]
    # some decode call ended early (decode_steps counts the mixed calls' one step each too)
    assert stats.decode_steps - stats.inserts < stats.decode_calls * engine.layout.steps


@pytest.mark.parametrize("longest_first", [False, True])
def test_longest_first_admits_by_max_tokens(llama, prompts, references, longest_first):
    """One row: requests end in the order they were admitted, by max_tokens, largest first
    (request order among equals), or in request order; the tokens are the same either way."""
    lengths = (3, 20, 5, 20)
    engine = paged(llama, "1dev", batch_size=1)
    ended = []
    requests = [Request(p, n) for p, n in zip(prompts, lengths)]
    Scheduler(engine, requests, longest_first=longest_first).run(
        lambda done: ended.extend((i, c[0].token_ids) for i, c in done))
    assert [i for i, _ in ended] == ([1, 3, 2, 0] if longest_first else [0, 1, 2, 3])
    assert sorted(ended) == [(i, references[i][:n]) for i, n in enumerate(lengths)]


def test_shared_prefixes_are_pages_taken_not_computed(llama, prompts):
    base = prompts[3][:32]
    reqs = [Request(base + p[:5], STEPS) for p in prompts[:4]]
    refs = [hf_greedy(llama, r.prompt, STEPS) for r in reqs]
    engine = paged(llama, "1dev")
    got, stats = generate(engine, reqs)
    assert [c.token_ids for c in got] == refs
    # the first computes the 32 shared tokens, the others the rest alone (and their last token)
    assert stats.prompt_tokens_computed < stats.prompt_tokens - 2 * 32


@pytest.mark.parametrize("mesh_name,pages", [("1dev", 0), pytest.param("1dev", 26, marks=pytest.mark.slow),
                                             ("data2_model4", 0)])
def test_windowed_layers_give_back_pages_that_left_the_window(mesh_name, pages):
    """GPT-OSS (window 8 on every other layer, sinks), prompts chunked: transformers' tokens.
    The windowed layers' pool holds too few pages for every row's whole length (4 rows of up to
    72 tokens, 18 pages each), so with room for every row in the full layers' pool nothing is
    preempted only if rows give back the pages that left their window; a small full pool
    preempts."""
    m = tiny_hf("gptoss", seed=5)
    rng = np.random.RandomState(7)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (30, 3, 41, 12, 25)]
    engine = paged(m, mesh_name, pages=pages)
    assert engine.layout.window == 8 and engine.layout.window_pages < engine.layout.rows_per_group * 18
    got, stats = generate(engine, [Request(p, STEPS) for p in prompts])
    assert (stats.preemptions > 0) == (pages > 0)
    assert [c.token_ids for c in got] == [hf_greedy(m, p, STEPS) for p in prompts]


SCANNED = [  # kind, mesh, pages per group (0: room for every row), prompts
    ("llama", "1dev", 0, 5),  # the CPU kernel
    ("gptoss", "data2_model4", 18, 3),  # under shard_map, preempting
    pytest.param("llama", "data2_model4", 20, 5, marks=pytest.mark.slow),
    pytest.param("gptoss", "1dev", 0, 5, marks=pytest.mark.slow),
    pytest.param("gptoss", "data2_model4", 20, 5, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,mesh_name,pages,n", SCANNED)
def test_scanned_layers_give_transformers_tokens(kind, mesh_name, pages, n):
    """programs.scan_layers: the layers in one loop over stacked weights and stacked pools, each
    layer writing and reading its own pages in place. Llama (a period of 1 layer, 2 deep) and
    GPT-OSS (4 layers: window 8, full, window 8, full; a period of 2, 2 deep, the windowed
    layers' pool and tables their own), prompts of 3 to 41 tokens in chunks of up to 16 beside
    decoding rows, and a full layers' pool small enough to preempt: transformers' tokens."""
    m = tiny_hf(kind, seed=5, **({"num_hidden_layers": 4} if kind == "gptoss" else {}))
    rng = np.random.RandomState(7)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (30, 3, 41, 12, 25)][:n]
    engine = paged(m, mesh_name, Policy(scan_layers=True), pages=pages)
    period = engine.model.scan_period
    assert (period, len(engine.cache.k)) == ((1, 1) if kind == "llama" else (2, 2))
    windows = engine.model.module.cache_spec(engine.model.config)[0][:period]
    assert [x.shape[1] for x in engine.cache.k] == [  # two layers' pages a pool
        2 * (engine.layout.window_pages if w else engine.layout.pages) for w in windows]
    got, stats = generate(engine, [Request(p, STEPS) for p in prompts])
    assert (stats.preemptions > 0) == (pages > 0)
    assert [c.token_ids for c in got] == [hf_greedy(m, p, STEPS) for p in prompts]


def _pool_copies(engine, pools: set) -> dict[str, set]:
    """Of each of the engine's compiled programs, the shapes (less their axes of one) among
    `pools` that it copies."""
    import re

    squeezed = lambda shape: tuple(d for d in shape if d != 1)
    found = {}
    for name, lowered in engine.lower().items():
        text = lowered.compile().as_text()
        found[name] = pools & {squeezed(int(d) for d in m.group(1).split(",")) for m in re.finditer(
            r"= \w+\[([\d,]+)\]\{[^}]*\} copy\(", text)}
    return found


def test_scanned_programs_copy_no_pool():
    """The scan carries the stacked pools and each layer writes and reads its pages of them in
    place: XLA:CPU's compiled programs (data2 x model4, attention in XLA, a kv head a device)
    hold no copy of a device's pool, nor of one layer's pages of it."""
    m = tiny_hf("gptoss", seed=5, num_hidden_layers=4)
    engine = paged(m, "data2_model4", Policy(scan_layers=True, kernels=False))
    pools = set()
    for x in engine.cache.k:  # a device's [1, 2 * P, 1, S, H]: 2 layers' pages of 1 kv head
        pages, *rest = (d for d in x.addressable_shards[0].data.shape if d != 1)
        pools |= {(pages, *rest), (pages // 2, *rest), (2, pages // 2, *rest)}
    assert _pool_copies(engine, pools) == dict.fromkeys(engine.lower(), set())


def test_a_one_row_decode_copies_no_pool(llama):
    """One row on one device through podrun's CPU attention kernel: a step's token is written
    into its pool in place, and the kernel reads the pool as written. (Handed the pool bitcast to
    [P, K, S, H], XLA fused the write into that bitcast as well, and copied every layer's pool at
    every decode step.)"""
    engine = paged(llama, "1dev", batch_size=1)
    pools = {tuple(d for d in x.shape if d != 1) for x in engine.cache.k}
    assert _pool_copies(engine, pools) == dict.fromkeys(engine.lower(), set())


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_logprobs_and_prompt_scores_are_transformers_whatever_the_chunks_and_preemption(llama, prompts):
    """Seeded sampling (n samples among them) with log-probabilities of the generated tokens, and
    prompts scored from a given token on, in a pool small enough to preempt: every token's
    log-probability and its 20 most likely alternatives are transformers' log_softmax of the
    logits after the prompt and the tokens before it; positions before prompt_logprobs_from may
    come from shared pages (None); a seeded request draws the same tokens as alone."""
    reqs = [Request(p, 12 if i % 2 else 9, temperature=0.9, top_p=0.8, top_k=40, seed=7 + i,
                    logprobs=True, n=2 if i % 3 == 0 else 1)
            for i, p in enumerate(prompts)]
    reqs.append(Request(prompts[3], 6, prompt_logprobs=True, prompt_logprobs_from=1))
    reqs.append(Request(prompts[3][:30] + prompts[1][:5], 0, prompt_logprobs=True, prompt_logprobs_from=30))
    got, stats = generate(paged(llama, "1dev", pages=18), reqs)
    assert stats.preemptions > 0
    alone, _ = generate(paged(llama, "1dev"), reqs[1:2])
    assert got[1].token_ids == alone[0].token_ids
    for r, out in zip(reqs, got):
        for c in out if isinstance(out, list) else [out]:
            sequence = list(r.prompt) + c.token_ids
            logp = _log_softmax(hf_logits(llama, [sequence])[0])  # [T, V]: next token's
            if r.logprobs:
                assert len(c.logprobs) == len(c.token_ids) == r.max_tokens
                for j, (t, x) in enumerate(zip(c.token_ids, c.logprobs)):
                    at = logp[len(r.prompt) - 1 + j]
                    assert abs(float(x.logprob) - at[t]) < 2e-4
                    np.testing.assert_allclose(np.asarray(x.top_logprobs, np.float64),
                                               np.sort(at)[::-1][:20], atol=2e-4)
                    assert int(x.top_ids[0]) == int(np.argmax(at))
            if r.prompt_logprobs:
                assert len(c.prompt_logprobs) == len(r.prompt) - 1
                for j in range(r.prompt_logprobs_from, len(r.prompt)):  # token j's, at j - 1
                    assert abs(float(c.prompt_logprobs[j - 1].logprob) - logp[j - 1, r.prompt[j]]) < 2e-4
    assert got[-1].token_ids == [] and got[-1].finish_reason == "length"


def test_stop_ids_end_a_sample_and_max_tokens_cut_it(llama, prompts, references):
    """A stop id ends a sample at its first occurrence (finish_reason stop, the id included);
    one that never comes leaves transformers' tokens to max_tokens (length)."""
    engine = paged(llama, "data2_model4")
    stop = references[1][6]  # request 1 stops at its 7th token, or sooner if that id came sooner
    got, _ = generate(engine, [Request(p, STEPS) for p in prompts[:4]], stop_ids=[stop])
    for c, ref in zip(got, references):
        if stop in ref:
            assert c.token_ids == ref[: ref.index(stop) + 1] and c.finish_reason == "stop"
        else:
            assert c.token_ids == ref and c.finish_reason == "length"
    short, _ = generate(engine, [Request(prompts[0], 5), Request(prompts[1], 9)])
    assert [c.token_ids for c in short] == [references[0][:5], references[1][:9]]


def test_a_host_stop_check_ends_a_sample(llama, prompts, references):
    engine = paged(llama, "1dev")
    got, _ = generate(engine, [Request(prompts[0], STEPS)], stop_check=lambda i, ids: len(ids) >= 3)
    assert got[0].token_ids[:3] == references[0][:3] and got[0].finish_reason == "stop"
    assert len(got[0].token_ids) <= 3 + engine.layout.steps


def test_a_seeded_request_samples_the_same_tokens_wherever_it_runs(llama, prompts, references):
    """A seeded request draws the same tokens alone, beside others, admitted mid-run or
    preempted and recomputed; the same seeds draw the same again, others differ; top_k 1 is
    greedy whatever the temperature."""
    target = Request(prompts[1], 20, temperature=1.0, top_p=0.95, seed=42)
    alone = generate(paged(llama, "1dev", batch_size=2), [target])[0][0].token_ids
    others = [Request(p, n, temperature=0.8, seed=i) for i, (p, n) in
              enumerate(zip(prompts, (6, 11, 3, 17, 9, 14)))]
    for engine in (paged(llama, "data2_model4"), paged(llama, "1dev", pages=18)):
        mixed, stats = generate(engine, others[:3] + [target] + others[3:])
        assert mixed[3].token_ids == alone
    assert stats.preemptions > 0
    engine = paged(llama, "1dev")
    again = generate(engine, others + [dataclasses.replace(target, seed=43)])[0]
    assert [c.token_ids for c in again[:-1]] == [c.token_ids for c in mixed[:3] + mixed[4:]]
    assert again[-1].token_ids != alone
    greedy, _ = generate(engine, [Request(p, STEPS, temperature=0.9, top_k=1, seed=5) for p in prompts])
    assert [c.token_ids for c in greedy] == references


def test_n_samples_share_their_prompt_pages_and_are_independent_draws(llama):
    """A request of n samples is n rows that share the prompt's full pages: 8 samples of a
    20-token prompt compute it once, then each only what follows its last full page before the
    last token. Over 96 requests of 8 samples the first tokens follow transformers' softmax of
    the prompt's logits (chi-square), and two samples of one request are equal no more often than
    two independent draws (sum of p^2)."""
    prompt = tuple(int(t) for t in np.random.RandomState(9).randint(0, VOCAB, 20))
    engine = paged(llama, "1dev", batch_size=8)
    got, one = generate(engine, [Request(prompt, 3, temperature=1.0, seed=5, n=8)])
    shared = 4 * ((len(prompt) - 1) // 4)  # full pages of 4 before the last token
    assert (one.prompt_tokens, one.prompt_tokens_computed) == (8 * 20, 20 + 7 * (20 - shared))
    assert len({tuple(c.token_ids) for c in got[0]}) > 1
    assert got[0][0].token_ids == generate(engine, [Request(prompt, 3, 1.0, seed=5)])[0][0].token_ids

    requests = [Request(prompt, 1, temperature=1.0, seed=s, n=8) for s in range(96)]
    draws = np.array([[c.token_ids[0] for c in cs] for cs in generate(engine, requests)[0]])  # [96, 8]
    z = hf_logits(llama, [prompt])[0, -1].astype(np.float64)
    p = np.exp(z - z.max())
    p /= p.sum()
    seen = np.bincount(draws.reshape(-1), minlength=VOCAB)
    common = p * draws.size >= 5  # chi-square's bins: the likely tokens, the rest as one
    observed = np.append(seen[common], seen[~common].sum())
    expected = np.append(p[common], p[~common].sum()) * draws.size
    assert scipy_stats.chisquare(observed, expected).pvalue > 1e-3
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8)]
    equal = sum(int(np.sum(draws[:, a] == draws[:, b])) for a, b in pairs)
    trials, q = len(pairs) * len(draws), float(np.sum(p**2))
    assert abs(equal - trials * q) < 4 * np.sqrt(trials * q * (1 - q)) * 3  # pairs share samples


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2", pytest.param("gptoss", marks=pytest.mark.slow)])
def test_greedy_tokens_through_the_unembedding_screen_match_transformers(kind, prompts):
    """On one CPU device greedy tokens come through the int8 screen of the unembedding (Llama's
    lm_head [D, V], Qwen2's and GPT-2's tied embedding [V, D], GPT-OSS's lm_head [V, D]): the
    tokens are transformers' greedy ones, and a sampled row beside greedy ones changes none of
    theirs. kernels.greedy_screen=False, or several devices, make no screen."""
    m = tiny_hf(kind, seed=5)
    engine = paged(m, "1dev", batch_size=3)
    assert engine.greedy_screen is not None and engine.greedy_screen_bytes > 0
    lowered = engine.lower()
    assert all("podrun_greedy_screened" in f.as_text() for f in lowered.values()), list(lowered)
    rows = prompts[:3]
    want = [hf_greedy(m, p, STEPS) for p in rows]
    assert [c.token_ids for c in generate(engine, [Request(p, STEPS) for p in rows])[0]] == want
    mixed, _ = generate(engine, [Request(rows[0], STEPS), Request(rows[1], STEPS, temperature=1.0, seed=2),
                                 Request(rows[2], STEPS)])
    assert mixed[0].token_ids == want[0] and mixed[2].token_ids == want[2]
    assert paged(m, "1dev", Policy(greedy_screen=False), batch_size=3).greedy_screen is None
    assert paged(m, "data8", batch_size=8).greedy_screen is None


def test_an_int8_cache_keeps_the_float32_distributions(llama, prompts):
    """int8 pages with a scale per slot and head: each step's log-probabilities (the float32
    pool's tokens fed back as prompts) within quantisation error of the float32 pool's, and the
    CPU kernel (one device) and XLA's blocks (data2 x model4) agreeing. Every key is read back
    from its int8 page, the prompt's own too. Measured: at most 0.37 nats on this tiny model,
    whose noisy weights amplify the rounding (tests/test_quant.py); kernel and XLA within 2e-6."""
    ref, _ = generate(paged(llama, "1dev"), [Request(p, 8, logprobs=True) for p in prompts])
    reqs = [Request(p + tuple(c.token_ids[:k]), 1, logprobs=True)
            for p, c in zip(prompts, ref) for k in range(8)]
    want = [x for c in ref for x in c.logprobs]
    top = lambda x: dict(zip(map(int, x.top_ids[:5]), map(float, x.top_logprobs[:5])))
    runs = []
    for mesh_name in ("1dev", "data2_model4"):
        engine = paged(llama, mesh_name, Policy(kv_cache="int8"))
        assert engine.cache.k[0].dtype == np.int8
        got, _ = generate(engine, reqs)
        runs.append([top(c.logprobs[0]) for c in got])
    worst = 0.0
    for a, b, w in zip(*runs, want):
        w = top(w)
        assert a.keys() == b.keys() and len(a.keys() & w.keys()) >= 3
        assert max(abs(a[i] - b[i]) for i in a) < 1e-4
        worst = max(worst, max(abs(a[i] - w[i]) for i in a.keys() & w.keys()))
    assert 0 < worst < 0.5, worst  # 0: the pages were not int8 after all


@pytest.mark.slow  # the interpreted kernels compile for minutes; tests/test_kernels.py checks them
@pytest.mark.parametrize("mesh_name,pages,scan", [("1dev", 0, False), ("data2_model4", 6, False),
                                                  ("data2_model4", 6, True)])
def test_the_tpu_kernels_give_transformers_tokens_in_interpret_mode(mesh_name, pages, scan,
                                                                    monkeypatch):
    """The paged engine with the TPU kernels (Backend.pallas_paged: folded pools, written and
    read by models/kernels/tpu/), run by Pallas' interpreter on CPU: GPT-OSS (window 8 on every
    other layer, sinks), prompts chunked, per group and kv-head shard under shard_map, and a pool
    small enough to preempt; scan: 4 layers in a loop over stacked pools, 2 deep."""
    from functools import partial

    from models.backend import Backend
    from models.kernels import tpu

    monkeypatch.setattr(Backend, "resolve", classmethod(lambda cls, policy, rules: cls(
        "cpu", pallas_paged="tpu")))
    for module, name in ((tpu.attention, "paged_attention"), (tpu, "write_pages")):
        monkeypatch.setattr(module, name, partial(getattr(module, name), interpret=True))
    m = tiny_hf("gptoss", seed=5, **({"num_hidden_layers": 4} if scan else {}))
    rng = np.random.RandomState(7)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (30, 3, 41, 12, 25)]
    engine = paged(m, mesh_name, Policy(scan_layers=scan), pages=pages, page_size=16)
    assert engine.cache.k[0].shape[3:] == (2, 128)  # head_dim 16: 8 slots a row
    assert len(engine.cache.k) == (2 if scan else 3)
    got, stats = generate(engine, [Request(p, STEPS) for p in prompts])
    assert (stats.preemptions > 0) == (pages > 0)
    assert [c.token_ids for c in got] == [hf_greedy(m, p, STEPS) for p in prompts]


@pytest.mark.parametrize("kind,mesh_name,pages", [("llama", "1dev", 0), ("gptoss", "data2_model4", 20)])
def test_the_gpu_kernel_gives_transformers_tokens_in_interpret_mode(kind, mesh_name, pages,
                                                                    monkeypatch):
    """The paged engine with the GPU's attention over pages (Backend.pallas_paged "gpu":
    models/kernels/gpu.paged_attention, pools as XLA writes them), run by Pallas' interpreter on
    CPU: Llama on one device; GPT-OSS (window 8 on every other layer, sinks) per group and kv-head
    shard under shard_map with a pool small enough to preempt; prompts chunked."""
    from models.backend import Backend
    from models.kernels import gpu

    monkeypatch.setattr(Backend, "resolve", classmethod(lambda cls, policy, rules: cls(
        "cpu", pallas_paged="gpu")))
    calls, real = [], gpu.paged_attention

    def interpreted(*args, **kw):
        calls.append(args[1].shape)
        return real(*args, **kw, interpret=True)

    monkeypatch.setattr(gpu, "paged_attention", interpreted)
    m = tiny_hf(kind, seed=5)
    rng = np.random.RandomState(7)
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (30, 3, 41, 12, 25)]
    engine = paged(m, mesh_name, pages=pages)
    got, stats = generate(engine, [Request(p, STEPS) for p in prompts])
    assert calls and (stats.preemptions > 0) == (pages > 0)
    assert [c.token_ids for c in got] == [hf_greedy(m, p, STEPS) for p in prompts]
