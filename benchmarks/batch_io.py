"""What reading an OpenAI Batch file and writing its results cost, against the whole job's wall time.

    python benchmarks/batch_io.py [--requests=10000] [--max_tokens=4] [--batch_size=64]

A random tiny Llama (`random:llama:tiny`, no tokenizer: prompts are token ids, as the completions
API takes them), one CPU device; `--requests` Batch lines of /v1/completions, each a 4-to-12-token
prompt and `max_tokens` new tokens, every tenth asking for logprobs. The model is loaded once and
a small job compiles the programs first, so the measured job is the file's alone: its wall time
(runner.job.answer) and, inside it, the time spent in the I/O path: reading the file, the
format check and duplicate custom_ids, parsing each line, building each result (podrun's, then
the Batch line) and appending the partial file and writing the final one.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

SPENT: collections.Counter = collections.Counter()  # seconds per I/O step, this job's


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] += time.perf_counter() - t0
    return wrapped


def _instrument() -> None:
    """Timers around every step of the I/O path, where runner.job calls it."""
    from runner import job, openai_batch, requests_io

    job.read_lines = _timed("read the file", job.read_lines)
    openai_batch.file_format = _timed("format, duplicate custom_ids", openai_batch.file_format)
    openai_batch.parse_line = _timed("parse lines", openai_batch.parse_line)
    job._result_line = _timed("podrun result dicts", job._result_line)
    openai_batch.result_line = _timed("Batch result lines", openai_batch.result_line)
    openai_batch.error_line = _timed("Batch result lines", openai_batch.error_line)
    for method in ("__init__", "open", "add", "write_final"):
        name = "append the partial file" if method == "add" else "partial file read, final file written"
        setattr(requests_io.Results, method, _timed(name, getattr(requests_io.Results, method)))


def _write(path: str, n: int, max_tokens: int, vocab: int) -> str:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            body = {"model": "tiny", "prompt": [int(t) for t in rng.integers(0, vocab, rng.integers(4, 13))],
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
            if i % 10 == 0:
                body["logprobs"] = 2
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": "/v1/completions",
                                "body": body}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--max_tokens", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=64)
    a = ap.parse_args()

    from configs.cpu import get_config
    from runner.checkpoints import convert
    from runner.cli import setup_devices
    from runner.job import answer, load_model
    from runner.settings import from_config

    folder = tempfile.mkdtemp(prefix="batch_io-")
    c = get_config(os.path.join(folder, "ck"))
    c.mesh.update(data=1, num_cpu_devices=1)
    c.generation.update(batch_size=a.batch_size, max_prompt_len=16, max_new_tokens=max(a.max_tokens, 1),
                        prefill_rows=a.batch_size)
    c.compilation_cache.dir = ""
    s = from_config(c)
    setup_devices(s)
    convert.random_checkpoint("llama:tiny", s.checkpoint_path)
    loaded = load_model(s)
    vocab = loaded[0].model.vocab_size

    warm = _write(os.path.join(folder, "warm.jsonl"), 4 * a.batch_size, a.max_tokens, vocab)
    answer(dataclasses.replace(s, input=warm, output=os.path.join(folder, "warm.out.jsonl")), loaded)

    _instrument()
    inp = _write(os.path.join(folder, "in.jsonl"), a.requests, a.max_tokens, vocab)
    out = os.path.join(folder, "out.jsonl")
    t0 = time.perf_counter()
    summary = answer(dataclasses.replace(s, input=inp, output=out), loaded)
    wall = time.perf_counter() - t0
    io = sum(SPENT.values())
    assert sum(1 for _ in open(out)) == a.requests
    print(f"{a.requests} Batch requests, {a.max_tokens} tokens each, batch_size {a.batch_size}: "
          f"{summary.completion_tokens} completion tokens; job wall {wall:.2f} s "
          f"(generation {summary.generate_s:.2f} s)")
    for name, t in SPENT.most_common():
        print(f"  {name:40s} {t:7.3f} s  {100 * t / wall:5.2f}%")
    print(f"  {'I/O in all':40s} {io:7.3f} s  {100 * io / wall:5.2f}% of the job's wall time")


if __name__ == "__main__":
    main()
