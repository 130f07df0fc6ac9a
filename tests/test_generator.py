"""runner.generator.Generator as a training loop calls it, against transformers and against
generators built fresh: generate, stream, update_weights, release, deadline and cancel."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from runner.checkpoints import store
from runner.checkpoints.convert import convert
from runner.engine import Completion, Request
from runner.generator import Generator, WeightsError
from sharding.rules import Rules
from sharding.mesh import MeshShape, make_mesh
from tests.reference import VOCAB, hf_greedy, tiny_hf

STEPS = 12
SETTINGS = {"generation.max_prompt_len": 48, "generation.max_new_tokens": STEPS,
            "generation.batch_size": 4, "generation.kv_cache_gib": 2**-8,
            "compilation_cache.dir": ""}
MESH = {"mesh.data": 2, "mesh.model": 4}  # the engine's weights sharded over heads


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas (transformers), each converted into a checkpoint: (hf, path)."""
    out = []
    for seed in (11, 12):
        m = tiny_hf("llama", seed=seed)
        root = tmp_path_factory.mktemp(f"llama{seed}")
        m.save_pretrained(root / "hf")
        convert(str(root / "hf"), str(root / "ck"))
        out.append((m, str(root / "ck")))
    return out


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(6)
    return [[int(t) for t in rng.randint(0, VOCAB, n)] for n in (7, 30, 2, 18, 41, 5)]


def compilations() -> list:
    """A list that grows by one for every XLA compilation (or compilation-cache load) from now."""
    seen = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: seen.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    return seen


def lines(prompts, **fields):
    return [{"id": f"r{i}", "prompt_token_ids": p, "max_tokens": STEPS, **fields}
            for i, p in enumerate(prompts)]


def test_generate_gives_transformers_tokens_and_later_calls_compile_nothing(models, prompts):
    (m, path), _ = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path, **SETTINGS, **MESH})
    first = gen.generate(lines(prompts))
    assert [r["id"] for r in first] == [f"r{i}" for i in range(len(prompts))]
    assert [r["token_ids"] for r in first] == [hf_greedy(m, p, STEPS) for p in prompts]
    seen = compilations()
    typed = gen.generate([Request(tuple(p), STEPS) for p in prompts])
    assert all(isinstance(c, Completion) for c in typed)
    assert [c.token_ids for c in typed] == [r["token_ids"] for r in first]
    streamed = dict(gen.stream(lines(prompts)))
    assert sorted(streamed) == list(range(len(prompts)))
    assert [streamed[i] for i in range(len(prompts))] == first
    assert seen == []


def test_a_bad_request_gets_its_error_and_the_others_their_answers(models, prompts):
    (m, path), _ = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path, **SETTINGS})
    out = gen.generate([{"prompt_token_ids": np.array(prompts[0]), "max_tokens": np.int64(STEPS)},
                        {"prompt_token_ids": prompts[1], "max_tokens": STEPS + 1},
                        {"prompt_token_ids": prompts[2], "max_tokenz": 3}])
    assert out[0]["token_ids"] == hf_greedy(m, prompts[0], STEPS)
    assert "max_tokens" in out[1]["error"] and "max_tokenz" in out[2]["error"]
    with pytest.raises(TypeError, match="not both"):
        gen.generate([Request((1, 2), 3), {"prompt_token_ids": [1, 2]}])


def test_update_weights_serves_the_new_weights_without_compiling(models, prompts):
    """A trainer's weights, replicated where the engine shards them over heads: the tokens are
    transformers' for those weights and a generator's built fresh on them, and nothing compiles."""
    (m1, path1), (m2, path2) = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path1, **SETTINGS, **MESH})
    before = gen.generate(lines(prompts))
    assert [r["token_ids"] for r in before] == [hf_greedy(m1, p, STEPS) for p in prompts]
    meta = store.load_metadata(path2)
    trainer = Rules.make(make_mesh(MeshShape(data=8), jax.devices()[:8]))  # replicated weights
    params = store.restore(path2, meta.model, trainer, jnp.float32)
    seen = compilations()
    gen.update_weights(params)
    after = gen.generate(lines(prompts))
    assert seen == []
    assert [r["token_ids"] for r in after] == [hf_greedy(m2, p, STEPS) for p in prompts]
    fresh = Generator("configs/cpu.py", {"checkpoint.path": path2, **SETTINGS, **MESH})
    assert fresh.generate(lines(prompts)) == after
    # the trainer's arrays are its own still
    assert all(not x.is_deleted() for x in jax.tree.leaves(params))
    # seeded samples too
    sampled = lines(prompts, temperature=0.9, seed=5)
    assert gen.generate(sampled) == fresh.generate(sampled)


def test_weights_that_do_not_match_are_refused_and_the_old_ones_serve(models, prompts):
    (m, path), _ = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path, **SETTINGS})
    want = hf_greedy(m, prompts[0], STEPS)
    meta = store.load_metadata(path)
    flat = store.flatten(store.restore(path, meta.model, gen.rules, jnp.float32))
    name = next(n for n in flat if n.endswith("wq"))
    cases = [({k: v for k, v in flat.items() if k != name}, f"weight {name} is missing"),
             ({**flat, "layers.0.extra": flat[name]}, "layers.0.extra is not a weight of llama"),
             ({**flat, name: flat[name][:, :1]}, f"weight {name} has shape"),
             ({**flat, name: flat[name].astype(jnp.bfloat16)}, f"weight {name} is bfloat16")]
    for params, message in cases:
        with pytest.raises(WeightsError, match=message):
            gen.update_weights(params)
        assert gen.generate([{"prompt_token_ids": prompts[0]}])[0]["token_ids"] == want


def test_released_memory_is_taken_again_by_the_next_generate(models, prompts):
    (m, path), (m2, path2) = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path, **SETTINGS})
    first = gen.generate(lines(prompts))
    pool = gen.memory()["kv_pool"]
    assert pool > 0
    live = lambda: sum(x.nbytes for x in jax.live_arrays())
    held = live()
    seen = compilations()
    gen.release()
    assert gen.memory()["kv_pool"] == 0 and held - live() >= pool
    assert gen.generate(lines(prompts)) == first
    gen.release(weights=True)
    assert gen.memory() == {"weights": 0, "kv_pool": 0}
    with pytest.raises(WeightsError, match="update_weights"):
        gen.generate(lines(prompts))
    meta = store.load_metadata(path2)
    gen.update_weights(store.restore(path2, meta.model, gen.rules, jnp.float32))
    assert gen.memory()["kv_pool"] == 0  # new weights do not take the pool back: generate does
    assert [r["token_ids"] for r in gen.generate(lines(prompts))] == [
        hf_greedy(m2, p, STEPS) for p in prompts]
    assert seen == []


def test_cancel_and_deadline_end_every_request_with_what_it_has(models, prompts):
    """Requests of several lengths, a step a call: cancelled once the first ends, every
    other ends then with the start of its uncut tokens; past a deadline of 0, with none."""
    (m, path), _ = models
    gen = Generator("configs/cpu.py", {"checkpoint.path": path, **SETTINGS,
                                       "generation.steps_per_dispatch": 1})
    requests = [{"prompt_token_ids": p, "max_tokens": 2 + 2 * i} for i, p in enumerate(prompts)]
    full = [hf_greedy(m, p, r["max_tokens"]) for p, r in zip(prompts, requests)]
    cancel = threading.Event()
    out = {}
    for i, r in gen.stream(requests, cancel=cancel):
        out[i] = r
        cancel.set()
    reasons = [out[i]["finish_reason"] for i in range(len(prompts))]
    assert reasons.count("length") == 1 and reasons.count("cancelled") == len(prompts) - 1
    for i, r in out.items():
        assert r["token_ids"] == full[i][: len(r["token_ids"])]
    assert 0 < sum(len(r["token_ids"]) for r in out.values()) < sum(map(len, full))
    scored = [{**r, "logprobs": True, "continuation": [1, 2]} for r in requests]
    late = gen.generate(scored, deadline_s=0.0)
    assert {r["finish_reason"] for r in late} == {"deadline"}
    assert all(r["token_ids"] == [] and r["logprobs"] == {"content": []} and "continuation" not in r
               for r in late)
