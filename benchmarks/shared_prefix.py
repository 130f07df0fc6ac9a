"""Jobs whose prompts share a prefix, with prefix sharing on and off (and n samples against n
prompts), alternated round by round in one process on one model load, so that the machine's
swings of speed fall on both alike.

    python benchmarks/shared_prefix.py --config=configs/smollm2_cpu.py [--rounds=2] [--jobs=fewshot,samples]

- fewshot: 256 requests behind one 700-token prefix, each with its own question of 20-40 tokens,
  16 new tokens each: wall time with generation.prefix_tokens on (the config's) and 0;
- samples: one 1,000-token prompt with n = 8 (sampled, 64 tokens each) against 8 different
  1,000-token prompts of one sample: time per completion token, and prompt tokens computed.

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

from runner.cli import setup_devices  # noqa: E402
from runner.job import answer, load_model  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)
_ROUNDS = flags.DEFINE_integer("rounds", 2, "rounds of both settings")
_JOBS = flags.DEFINE_list("jobs", ["fewshot", "samples"], "which jobs")


def _write(folder: str, name: str, rows: list[dict]) -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def main(argv: list[str]) -> None:
    c = bench.tool_config("shared_prefix", argv, _CONFIG.value)
    c.generation.max_prompt_len = max(c.generation.max_prompt_len, 1024)
    c.generation.max_new_tokens = max(c.generation.max_new_tokens, 64)
    s = from_config(c)
    setup_devices(s)
    loaded = load_model(s)
    vocab = loaded[0].model.vocab_size
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(0, vocab, n)]
    folder = tempfile.mkdtemp(prefix="shared_prefix-")
    prefix = ids(700)
    fewshot = _write(folder, "fewshot.jsonl", [
        {"prompt_token_ids": prefix + ids(int(rng.integers(20, 41))), "max_tokens": 16}
        for _ in range(256)])
    one = _write(folder, "n8.jsonl", [{"prompt_token_ids": ids(1000), "max_tokens": 64, "n": 8,
                                        "temperature": 1.0, "seed": 1}])
    eight = _write(folder, "eight.jsonl", [{"prompt_token_ids": ids(1000), "max_tokens": 64,
                                            "temperature": 1.0, "seed": i} for i in range(8)])
    g = s.generation

    def run(path: str, prefix_tokens: int) -> dict:
        out = os.path.join(folder, "out.jsonl")
        for stale in (out, out + ".partial"):
            if os.path.exists(stale):
                os.remove(stale)
        settings = dataclasses.replace(s, input=path, output=out, generation=dataclasses.replace(
            g, prefix_tokens=prefix_tokens))
        summary = answer(settings, loaded)
        st = summary.stats
        return {"wall_s": summary.generate_s, "completion_tokens": summary.completion_tokens,
                "s_per_token": summary.generate_s / max(1, summary.completion_tokens),
                "prompt_tokens": st.prompt_tokens, "computed": st.prompt_tokens_computed}

    for r in range(_ROUNDS.value):
        if "fewshot" in _JOBS.value:
            order = (0, g.prefix_tokens) if r % 2 else (g.prefix_tokens, 0)
            got = {p: run(fewshot, p) for p in order}
            on, off = got[g.prefix_tokens], got[0]
            print(f"round {r} fewshot: sharing on {on}, off {off}; wall time on / off "
                  f"{on['wall_s'] / off['wall_s']:.3f}", flush=True)
        if "samples" in _JOBS.value:
            first = (one, eight) if r % 2 == 0 else (eight, one)
            got = {p: run(p, g.prefix_tokens) for p in first}
            a, b = got[one], got[eight]
            print(f"round {r} samples: n=8 {a}, 8 prompts {b}; time per completion token n=8 / 8 "
                  f"prompts {a['s_per_token'] / b['s_per_token']:.3f}", flush=True)


if __name__ == "__main__":
    app.run(main)
