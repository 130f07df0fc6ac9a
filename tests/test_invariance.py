"""Batch invariance (docs/batch-invariance.md), as a rollout loop relies on it: a request's tokens
and log-probabilities are the same bits whatever rows share its steps (how many, which, in decode
or mixed programs, preempted and recomputed or not) on one CPU device with podrun's kernels, in
float32, int8 and int4; and the log-probabilities a generation returns are those podrun's own
scoring of the same tokens gives, bitwise, and transformers' to float32's rounding."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from runner.checkpoints.convert import convert
from tests.reference import tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# SmolLM2's vocabulary: XLA:CPU handed a softmax's sum over this many logits of one row to
# YNNPACK, and of several rows to its own loop, which sum in different orders
V = 49152
STEPS = 10
SETTINGS = {"generation.max_prompt_len": 64, "generation.max_new_tokens": STEPS,
            "generation.chunk_tokens": 16, "compilation_cache.dir": ""}

# The generators run where a deployment on one CPU device runs them (configs/cpu.py's one
# device, podrun's kernels): in a process of their own, this one simulating 8 devices. Each of
# `runs` ({"overrides", "requests", "alone", "score"}) answers its requests together (with
# alone, each request by itself too; with score, podrun's scoring of each prompt + completion,
# in the same generator); the results and the first call's preemptions and busiest rows go to
# stdout as JSON.
CHILD = """
import json, sys
from runner.generator import Generator
out = []
for run in json.load(sys.stdin):
    gen = Generator("configs/cpu.py", run["overrides"])
    together = gen.generate(run["requests"])
    stats = gen.stats
    alone = [gen.generate([r])[0] for r in run["requests"]] if run.get("alone") else []
    scored = gen.generate([{"prompt_token_ids": r["prompt_token_ids"] + a["token_ids"],
                            "max_tokens": 0, "prompt_logprobs": 0}
                           for r, a in zip(run["requests"], together)]) if run.get("score") else []
    out.append({"together": together, "alone": alone, "scored": scored,
                "preemptions": stats.preemptions, "rows_peak": stats.rows_peak})
print(json.dumps(out))
"""


def generate(runs: list[dict]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(runs), cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama with SmolLM2's vocabulary (transformers), converted: (hf, checkpoint path)."""
    m = tiny_hf("llama", seed=3, vocab_size=V)
    root = tmp_path_factory.mktemp("invariance")
    m.save_pretrained(root / "hf")
    convert(str(root / "hf"), str(root / "ck"))
    return m, str(root / "ck")


def requests() -> list[dict]:
    """Prompts of 2 to 41 tokens (several chunks of 16 beside decoding rows), greedy and seeded,
    each token's log-probability asked for."""
    rng = np.random.RandomState(8)
    out = []
    for i, n in enumerate((7, 41, 2, 30, 18, 5, 25)):
        r = {"prompt_token_ids": rng.randint(0, V, n).tolist(), "max_tokens": STEPS, "logprobs": 0}
        out.append({**r, "temperature": 0.9, "seed": 40 + i} if i % 2 else r)
    return out


def answered(results: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(r["token_ids"], [c["logprob"] for c in r["logprobs"]["content"]]) for r in results]


@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_a_requests_tokens_and_logprobs_do_not_depend_on_the_rows_beside_it(llama, quantize):
    """One row at a time against five at once in a pool too small for them (rows preempted and
    their tokens computed again), and each request alone in those five rows: every token and
    log-probability the same bits."""
    _, path = llama
    common = {"checkpoint.path": path, "precision.quantize": quantize, **SETTINGS}
    alone, crowded = generate([
        {"overrides": {**common, "generation.batch_size": 1}, "requests": requests()},
        {"overrides": {**common, "generation.batch_size": 5, "generation.kv_cache_gib": 2**-14},
         "requests": requests(), "alone": True}])
    want = answered(alone["together"])
    assert answered(crowded["together"]) == want
    assert crowded["preemptions"] > 0 and crowded["rows_peak"] > 1
    assert answered(crowded["alone"]) == want


def test_generated_logprobs_are_the_scoring_of_the_same_tokens_and_transformers(llama):
    """float32: each generated token's log-probability equals, bitwise, the one podrun's scoring
    (max_tokens 0, prompt_logprobs) gives it after prompt + completion, run in other rows and
    programs; and transformers' log_softmax of a teacher-forced forward to 5e-5 (float32 sums
    over 49,152 logits: 1.5e-5 here)."""
    m, path = llama
    reqs = requests()
    overrides = {"checkpoint.path": path, "generation.batch_size": 3, **SETTINGS}
    [run] = generate([{"overrides": overrides, "requests": reqs, "score": True}])
    generated = answered(run["together"])
    for r, (tokens, logprobs), s in zip(reqs, generated, run["scored"]):
        n = len(r["prompt_token_ids"])
        assert [c["logprob"] for c in s["prompt_logprobs"][n:]] == logprobs
        with torch.no_grad():
            logits = m(torch.tensor([r["prompt_token_ids"] + tokens])).logits[0, n - 1:-1].double()
        hf = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens].numpy()
        np.testing.assert_allclose(logprobs, hf, rtol=0, atol=5e-5)
