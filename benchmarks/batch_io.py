"""What reading an OpenAI Batch file and writing its results cost, against the whole job's wall time.

    python benchmarks/batch_io.py [--requests=10000] [--max_tokens=4] [--batch_size=64] [--chat]
    python benchmarks/batch_io.py --chat --parse_only [--requests=2000] [--rounds=3]

A random tiny Llama (`random:llama:tiny`, no tokenizer: prompts are token ids, as the completions
API takes them), one CPU device; `--requests` Batch lines of /v1/completions, each a 4-to-12-token
prompt and `max_tokens` new tokens, every tenth asking for logprobs. `--chat`: /v1/chat/completions
lines of a system and a user message on a random tiny GPT-OSS (`random:gptoss:tiny-o200k`), so
that parsing includes rendering Harmony and the results its channel parsing.

A small job compiles the programs first, and the model's loading is left out, so the measured
time is the file's alone: the job's wall time (runner.job.answer) and, inside it, the time spent
in the I/O path: reading the file, the format check and duplicate custom_ids, parsing each line,
reading each request's completions into its answer, writing that as its Batch line, appending the
partial file and writing the final one. `--parse_only`: no model, no job; the microseconds a line
that parsing the file's lines takes (runner.api.formats.parse_line, with the job's Harmony rendering
for --chat), per round.
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

from configs.cpu import get_config  # noqa: E402
from runner import job  # noqa: E402
from runner.api import common, formats, openai_batch  # noqa: E402
from runner.api.common import read_lines  # noqa: E402
from runner.checkpoints import convert  # noqa: E402
from runner.checkpoints.load import load_model  # noqa: E402
from runner.cli import setup_devices  # noqa: E402
from runner.results import writer  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.text import o200k  # noqa: E402
from runner.text.chat import chat_format  # noqa: E402
from runner.text.tokenizer import load_tokenizer  # noqa: E402

SPENT: collections.Counter = collections.Counter()  # seconds per I/O step, this job's


def _timed(name: str, fn, into: collections.Counter = SPENT):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[name] += time.perf_counter() - t0
    return wrapped


def _instrument() -> None:
    """Timers around every step of the I/O path, where runner.job calls it."""
    job.read_lines = _timed("read the file", job.read_lines)
    formats.file_format = _timed("format, duplicate custom_ids", formats.file_format)
    formats.parse_line = _timed("parse lines", formats.parse_line)
    common.build_answer = _timed("answers (decoded, chat format read)", common.build_answer)
    openai_batch.result_line = _timed("Batch result lines", openai_batch.result_line)
    openai_batch.error_line = _timed("Batch result lines", openai_batch.error_line)
    for method in ("__init__", "open", "add", "write_final"):
        name = "append the partial file" if method == "add" else "partial file read, final file written"
        setattr(writer.Results, method, _timed(name, getattr(writer.Results, method)))


WORDS = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()


def _write(path: str, n: int, max_tokens: int, vocab: int, chat: bool) -> str:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            if chat:
                words = " ".join(rng.choice(WORDS, rng.integers(3, 10)))
                body = {"model": "tiny", "messages": [{"role": "system", "content": "Answer in one word."},
                                                      {"role": "user", "content": words}],
                        "max_completion_tokens": max_tokens, "temperature": 0.7, "seed": i}
            else:
                body = {"model": "tiny", "prompt": [int(t) for t in rng.integers(0, vocab, rng.integers(4, 13))],
                        "max_tokens": max_tokens, "temperature": 0.7, "seed": i}
            if i % 10 == 0:
                body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
            url = "/v1/chat/completions" if chat else "/v1/completions"
            f.write(json.dumps({"custom_id": f"request-{i}", "method": "POST", "url": url, "body": body}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--max_tokens", type=int, default=4)
    ap.add_argument("--batch_size", type=int, default=64)
    ap.add_argument("--chat", action="store_true", help="chat lines on a tiny GPT-OSS with its tokenizer")
    ap.add_argument("--parse_only", action="store_true", help="time parsing the lines alone, no model")
    ap.add_argument("--rounds", type=int, default=3, help="--parse_only: passes over the lines")
    a = ap.parse_args()
    if a.parse_only:
        return _parse_only(a)

    folder = tempfile.mkdtemp(prefix="batch_io-")
    c = get_config(os.path.join(folder, "ck"))
    c.mesh.update(data=1, num_cpu_devices=1)
    c.generation.update(batch_size=a.batch_size, max_prompt_len=128 if a.chat else 16,
                        max_new_tokens=max(a.max_tokens, 1))
    # the warm job's programs, compiled into a cache of this run's own, are loaded by the measured
    # job's engine (each job builds one) rather than compiled again in its wall time
    c.compilation_cache.dir = os.path.join(folder, "xla")
    s = from_config(c)
    setup_devices(s)
    convert.random_checkpoint("gptoss:tiny-o200k" if a.chat else "llama:tiny", s.checkpoint_path)
    loaded = None if a.chat else load_model(s)  # answer() loads a chat model itself: with its tokenizer
    vocab = 0 if a.chat else loaded[0].model.vocab_size

    warm = _write(os.path.join(folder, "warm.jsonl"), 4 * a.batch_size, a.max_tokens, vocab, a.chat)
    job.answer(dataclasses.replace(s, input=warm, output=os.path.join(folder, "warm.out.jsonl")), loaded)

    _instrument()

    loading = collections.Counter()  # a chat job loads its model (and tokenizer): not the file's time
    job.open_checkpoint = _timed("load", job.open_checkpoint, loading)
    job.restore = _timed("load", job.restore, loading)
    inp = _write(os.path.join(folder, "in.jsonl"), a.requests, a.max_tokens, vocab, a.chat)
    out = os.path.join(folder, "out.jsonl")
    t0 = time.perf_counter()
    summary = job.answer(dataclasses.replace(s, input=inp, output=out), loaded)
    wall = time.perf_counter() - t0 - loading["load"]
    io = sum(SPENT.values())
    assert sum(1 for _ in open(out)) == a.requests
    kind = "chat" if a.chat else "completions"
    print(f"{a.requests} {kind} Batch requests, {a.max_tokens} tokens each, batch_size {a.batch_size}: "
          f"{summary.completion_tokens} completion tokens; job wall {wall:.2f} s without loading the model "
          f"(generation {summary.generate_s:.2f} s)")
    for name, t in SPENT.most_common():
        print(f"  {name:40s} {t:7.3f} s  {100 * t / wall:5.2f}%")
    print(f"  {'I/O in all':40s} {io:7.3f} s  {100 * io / wall:5.2f}% of the job's wall time")


def _parse_only(a) -> None:
    c = get_config("/unused")
    c.generation.update(max_prompt_len=128 if a.chat else 16, max_new_tokens=max(a.max_tokens, 1))
    s = from_config(c)
    folder = tempfile.mkdtemp(prefix="batch_io-")
    tokenizer, render, vocab = None, None, 1000
    if a.chat:
        o200k.write_tokenizer_files(folder)
        tokenizer, vocab = load_tokenizer(folder), o200k.VOCAB_SIZE
        render = chat_format("gptoss", tokenizer, s.generation.reasoning_effort)
    lines = read_lines(_write(os.path.join(folder, "in.jsonl"), a.requests, a.max_tokens, vocab, a.chat))
    fmt = formats.file_format(lines)
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        parsed = [formats.parse_line(i, x, fmt, tokenizer, s, vocab, render) for i, x in enumerate(lines)]
        us = 1e6 * (time.perf_counter() - t0) / len(lines)
        assert not any(p.error for p in parsed), next(p.error for p in parsed if p.error)
        print(f"{len(lines)} {'chat' if a.chat else 'completions'} Batch lines parsed: {us:.1f} us a line")


if __name__ == "__main__":
    main()
