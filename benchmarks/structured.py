"""Structured output's cost: a job with half its requests under a JSON schema against the same job
with none, alternated round by round in one process on one model load (the machine's swings of
speed fall on both alike); and what compiling the schemas costs.

    python benchmarks/structured.py --config=configs/smollm2_cpu.py [--rounds=3] [--requests=32] \
        [--schemas=describe|heldout] [--max_tokens=128]

The job: `requests` chat requests, greedy, 8 rows; every other one asks for JSON under a schema
(`response_format` json_schema), the rest for free text. --schemas=describe: one schema of an
extraction job (a name, a summary of 60-240 characters, 3-5 facts, a rating), whose JSON is about
as long as the free answers; heldout: the held-out schemas of tests/data/structured_cases.jsonl
in turn (1-4 small fields: their JSON ends after ~20 tokens, the free answers at max_tokens, so
the job with formats also spends more of its time in prefill per token). The unconstrained job
is the same lines without their formats. Both are parsed as runner.job does (formats.request_parser)
and run through the engine the config builds (runner.engine.Scheduler), so that after a first run
of each no program compiles (each run reports the programs it compiled, 0 after the first; a run
starts with an empty pool, its prompts sharing full pages among themselves alone).
Prints each run's completion tokens/s (completion tokens over the scheduler's wall time), the
ratio per round, the decode calls that ran one step under masks, and the host's mask time; then
the time to compile each of the 100 held-out schemas for the tokenizer (fresh cache) and to find
one already compiled; then a decode step's time with every row live (random tokens, each row on
pages of its own whose contents speed does not depend on) in three settings, alternated:
steps_per_dispatch steps a call unmasked, one step a call under masks allowing everything (the
screen's greedy token always allowed), and one step a call with half the rows allowed even ids
only (the logits made on most steps).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from runner.api import formats  # noqa: E402
from runner.api.common import Line  # noqa: E402
from runner.checkpoints.load import load_model  # noqa: E402
from runner.cli import setup_devices  # noqa: E402
from runner.engine import Engine, Scheduler  # noqa: E402
from runner.engine.build import build_engine  # noqa: E402
from runner.engine.engine import Step  # noqa: E402
from runner.settings import from_config  # noqa: E402
from runner.text import structured  # noqa: E402
from runner.text.tokenizer import load_tokenizer  # noqa: E402
from runner.tools import bench  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "rounds of both settings")
_REQUESTS = flags.DEFINE_integer("requests", 32, "requests per job")
_SCHEMAS = flags.DEFINE_enum("schemas", "describe", ["describe", "heldout"], "the JSON requests' schemas")
_PARTS = flags.DEFINE_list("parts", ["job", "compile", "steps"], "what to measure")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 128, "max_tokens of every request")

CASES = os.path.join(ROOT, "tests", "data", "structured_cases.jsonl")
TOPICS = ["a city", "a cat", "the weather", "a recipe", "a friend", "a book", "a river", "a game"]
DESCRIBE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 40},
    "summary": {"type": "string", "minLength": 60, "maxLength": 240},
    "facts": {"type": "array", "items": {"type": "string", "minLength": 5, "maxLength": 60},
              "minItems": 3, "maxItems": 5},
    "rating": {"type": "integer", "minimum": 1, "maximum": 10}},
    "required": ["name", "summary", "facts", "rating"], "additionalProperties": False}


def main(argv: list[str]) -> None:
    c = bench.tool_config("structured", argv, _CONFIG.value)
    c.generation.max_new_tokens = max(c.generation.max_new_tokens, _MAX_TOKENS.value)
    s = from_config(c)
    setup_devices(s)
    meta, rules, params = load_model(s)
    tokenizer = load_tokenizer(s.checkpoint_path)
    engine = build_engine(s, meta.model, params, rules)
    vocab = meta.model.vocab_size
    with open(CASES, encoding="utf-8") as f:
        schemas = [r["schema"] for r in map(json.loads, f) if r["kind"] == "json_schema"]
    rows = {True: [], False: []}  # with formats, without
    for i in range(_REQUESTS.value):
        topic = TOPICS[i % len(TOPICS)]
        line = {"id": i, "max_tokens": _MAX_TOKENS.value}
        if i % 2:
            line["messages"] = [{"role": "user", "content": f"Describe {topic} as a JSON object."}]
            rows[False].append(dict(line))
            schema = DESCRIBE if _SCHEMAS.value == "describe" else schemas[i % len(schemas)]
            line["response_format"] = {"type": "json_schema", "json_schema": {
                "name": f"s{i}", "schema": schema, "strict": True}}
        else:
            line["messages"] = [{"role": "user", "content": f"Write a few sentences about {topic}."}]
            rows[False].append(dict(line))
        rows[True].append(line)
    jobs = {}
    for k, rs in rows.items():
        lines = [Line(i + 1, json.dumps(r)) for i, r in enumerate(rs)]
        chat, stop_ids, parse = formats.request_parser(s, meta.model, tokenizer,
                                                       formats.file_format(lines))
        parsed = [parse(i, line) for i, line in enumerate(lines)]
        if bad := [p.error for p in parsed if p.error]:
            raise SystemExit(f"structured: a request failed: {bad[0]}")
        jobs[k] = [p.request() for p in parsed]

    compiled = []

    @contextlib.contextmanager
    def compiling(what: str):
        compiled.append(what)
        yield

    engine.announce = compiling

    def run(formats: bool) -> dict:
        done, compiled[:] = [], []
        t = time.perf_counter()
        st = Scheduler(engine, jobs[formats], stop_ids).run(done.extend)
        wall = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for _, cs in done for c in cs)
        return {"tokens_per_s": round(tokens / wall, 1), "completion_tokens": tokens,
                "wall_s": round(wall, 2), "decode_calls": st.decode_calls,
                "masked_calls": st.masked_calls, "mask_ms": round(1e3 * st.mask_s, 1),
                "insert_s": round(st.insert_s, 2), "decode_s": round(st.decode_s, 2),
                "compiled": len(compiled),
                "incomplete": sum(c.incomplete_format for _, cs in done for c in cs)}

    if "job" in _PARTS.value:
        run(True), run(False)  # compiles every program both jobs run
    ratios = []
    for r in range(_ROUNDS.value if "job" in _PARTS.value else 0):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {k: run(k) for k in order}
        ratios.append(got[True]["tokens_per_s"] / got[False]["tokens_per_s"])
        print(f"round {r}: half under formats {got[True]}; none {got[False]}; tokens/s ratio "
              f"{ratios[-1]:.3f}", flush=True)
    if ratios:
        print(f"completion tokens/s, half under formats / none: {min(ratios):.3f} to "
              f"{max(ratios):.3f}, median {statistics.median(ratios):.3f} over {len(ratios)} rounds",
              flush=True)
    if "compile" in _PARTS.value:
        compile_costs(structured.Grammars(tokenizer, vocab, chat.format_stop_ids(stop_ids),
                                          chat.grammar_start), schemas)
    if "steps" in _PARTS.value:
        step_costs(engine, vocab)


def compile_costs(grammars: structured.Grammars, schemas: list[dict]) -> None:
    """`grammars`: a fresh cache."""
    t = time.perf_counter()
    grammars._lltokenizer()
    print(f"the tokenizer's vocabulary for llguidance: {time.perf_counter() - t:.2f} s, once per job")
    formats = [structured.parse_format({"guided_json": x}) for x in schemas]
    fresh, cached = [], []
    for fmt in formats:
        t = time.perf_counter()
        grammars.compile(fmt)
        fresh.append(time.perf_counter() - t)
    for fmt in formats:
        t = time.perf_counter()
        grammars.compile(fmt).start()
        cached.append(time.perf_counter() - t)
    q = lambda xs: f"median {1e3 * statistics.median(xs):.2f} ms, max {1e3 * max(xs):.2f} ms"
    print(f"compiling {len(formats)} schemas: {q(fresh)}; a compiled one found and started: {q(cached)}")


def step_costs(engine: Engine, vocab: int, steps: int = 64, rounds: int = 3) -> None:
    L = engine.layout
    G, R, B = L.groups, L.rows_per_group, L.batch_size
    rng = np.random.default_rng(0)
    every = np.full((B, L.mask_words), -1, np.int32)
    bits = np.zeros(L.mask_words * 32, np.uint8)
    bits[:vocab:2] = 1
    half = every.copy()
    half[: B // 2] = np.packbits(bits, bitorder="little").view(np.int32)
    settings = {f"{L.steps} steps a call": (None, L.steps), "1 step, masks allow all": (every, 1),
                "1 step, half the rows even ids": (half, 1)}
    times = {k: [] for k in settings}
    start = 20  # each row's position, as if after a prompt of 20 tokens
    steps = min(steps, L.max_new_tokens - 1)  # no row reaches its max_tokens
    # every row on pages of its own where the pool has enough (else sharing some: only the keys
    # and values they hold differ, and speed does not depend on those)
    tables = np.arange(R * L.max_pages).reshape(R, L.max_pages)
    windows = tables % L.window_pages if L.window_pages else np.zeros_like(tables)

    def live() -> Step:
        """A decode call's host arrays with every row live at position `start`."""
        b = L.empty_step(0)
        b.tokens[:, :R] = rng.integers(0, vocab, (G, R))
        b.positions[:, :R] = start
        b.tables[:], b.window_tables[:] = tables % L.pages, windows
        b.live[:], b.max_tokens[:], b.seed[:] = True, L.max_new_tokens, np.arange(B)
        return b

    for r in range(rounds + 1):
        for name, (masks, per_call) in settings.items():
            b = live()
            t, n = time.perf_counter(), 0
            while n + per_call <= steps:
                out, _, _ = engine.call(b, (), per_call, masks=masks)
                b.tokens[:, :R] = out[:, -1].reshape(G, R)
                b.positions[:, :R] += per_call
                b.count[:] += per_call
                n += per_call
            if r:  # round 0 compiles
                times[name].append((time.perf_counter() - t) / n)
    for name, ts in times.items():
        print(f"decode step, {name}: {', '.join(f'{1e3 * x:.1f}' for x in ts)} ms")


if __name__ == "__main__":
    app.run(main)
