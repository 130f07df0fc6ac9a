"""Jobs whose prompts share a prefix against the same jobs with the shared part made distinct (and
n samples against n prompts), alternated round by round in one process on one model load, so
that the machine's swings of speed fall on both alike.

    python benchmarks/shared_prefix.py --config=configs/smollm2_cpu.py [--rounds=2] [--jobs=fewshot,samples]

- fewshot: --requests requests (256) behind one --prefix-token prefix (700), each with its own
  question of 20-40 tokens, 16 new tokens each, against the same requests each behind a prefix of
  its own of that length: wall time and prompt tokens computed (the engine shares a prompt's full
  pages with every later prompt that starts with the same tokens; nothing turns that off);
- samples: one --prompt-token prompt (1,000) with n = 8 (sampled, 64 tokens each) against 8
  different prompts of that length of one sample: time per completion token, and prompt tokens
  computed.

Random token ids (speed does not depend on them), through the whole job (runner.job.answer, its
results into a throwaway file); prints each run's figures and the ratios per round.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from runner.checkpoints.load import load_model  # noqa: E402
from runner.cli import setup_devices  # noqa: E402
from runner.job import answer  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "rounds of both settings")
_JOBS = flags.DEFINE_list("jobs", ["fewshot", "samples"], "which jobs")
_REQUESTS = flags.DEFINE_integer("requests", 256, "fewshot: requests")
_PREFIX = flags.DEFINE_integer("prefix", 700, "fewshot: tokens of the prefix")
_PROMPT = flags.DEFINE_integer("prompt", 1000, "samples: tokens of each prompt")


def _write(folder: str, name: str, rows: list[dict]) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def main(argv: list[str]) -> None:
    c = bench.tool_config("shared_prefix", argv, _CONFIG.value)
    c.generation.max_prompt_len = max(c.generation.max_prompt_len, _PREFIX.value + 40, _PROMPT.value)
    c.generation.max_new_tokens = max(c.generation.max_new_tokens, 64)
    s = from_config(c)
    setup_devices(s)
    loaded = load_model(s)
    vocab = loaded[0].model.vocab_size
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(0, vocab, n)]
    folder = tempfile.mkdtemp(prefix="shared_prefix-")
    prefix = ids(_PREFIX.value)
    questions = [ids(int(rng.integers(20, 41))) for _ in range(_REQUESTS.value)]
    shared = _write(folder, "shared.jsonl", [{"prompt_token_ids": prefix + q, "max_tokens": 16}
                                             for q in questions])
    distinct = _write(folder, "distinct.jsonl", [
        {"prompt_token_ids": ids(_PREFIX.value) + q, "max_tokens": 16} for q in questions])
    one = _write(folder, "n8.jsonl", [{"prompt_token_ids": ids(_PROMPT.value), "max_tokens": 64,
                                        "n": 8, "temperature": 1.0, "seed": 1}])
    eight = _write(folder, "eight.jsonl", [{"prompt_token_ids": ids(_PROMPT.value), "max_tokens": 64,
                                            "temperature": 1.0, "seed": i} for i in range(8)])

    def run(path: str) -> dict:
        out = os.path.join(folder, "out.jsonl")
        for stale in (out, out + ".partial"):
            if os.path.exists(stale):
                os.remove(stale)
        summary = answer(dataclasses.replace(s, input=path, output=out), loaded)
        st = summary.stats
        return {"wall_s": summary.generate_s, "completion_tokens": summary.completion_tokens,
                "s_per_token": summary.generate_s / max(1, summary.completion_tokens),
                "prompt_tokens": st.prompt_tokens, "computed": st.prompt_tokens_computed}

    for r in range(_ROUNDS.value):
        if "fewshot" in _JOBS.value:
            order = (distinct, shared) if r % 2 else (shared, distinct)
            got = {p: run(p) for p in order}
            on, off = got[shared], got[distinct]
            print(f"round {r} fewshot: one prefix {on}, distinct prefixes {off}; wall time one / "
                  f"distinct {on['wall_s'] / off['wall_s']:.3f}", flush=True)
        if "samples" in _JOBS.value:
            first = (one, eight) if r % 2 == 0 else (eight, one)
            got = {p: run(p) for p in first}
            a, b = got[one], got[eight]
            print(f"round {r} samples: n=8 {a}, 8 prompts {b}; time per completion token n=8 / 8 "
                  f"prompts {a['s_per_token'] / b['s_per_token']:.3f}", flush=True)


if __name__ == "__main__":
    app.run(main)
