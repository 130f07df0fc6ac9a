"""The three grammar libraries side by side on podrun's tokenizers: llguidance, outlines-core and
xgrammar. For each, over the held-out JSON schemas of tests/data/structured_cases.jsonl: the time
to compile a schema for a tokenizer (median, p90, max; failures named), and the time to compute
one step's token mask along a random valid completion (median, p99). For outlines-core also the
size of its token-level automaton (states, transitions), which a device would have to hold.

    pip install llguidance==1.9.1 outlines-core==0.2.14 xgrammar==0.2.8
    python benchmarks/structured_libs.py --tokenizer=~/.cache/podrun/checkpoints/smollm2-135m-instruct
    python benchmarks/structured_libs.py --tokenizer=~/.cache/podrun/o200k_harmony --schemas=20

Written for docs/structured-output.md; podrun itself uses llguidance alone (runner/text/structured.py).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

import numpy as np

CASES = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "structured_cases.jsonl")
STEPS = 40  # mask computations timed per schema


def token_bytes(tokenizer_json: str) -> tuple[list[bytes], list[int], int]:
    """Every id's bytes (a byte-level BPE's alphabet mapped back), the special ids, the eos id."""
    from runner.text.tokenizer import _byte_to_unicode

    d = json.loads(tokenizer_json)
    back = {c: b for b, c in _byte_to_unicode().items()}
    vocab = d["model"]["vocab"]
    n = max(max(vocab.values()), *(t["id"] for t in d["added_tokens"])) + 1
    out = [b""] * n
    for s, i in vocab.items():
        out[i] = bytes(back[c] for c in s) if all(c in back for c in s) else s.encode()
    special = []
    for t in d["added_tokens"]:
        out[t["id"]] = t["content"].encode()
        special.append(t["id"])
    eos = next((t["id"] for t in d["added_tokens"] if t["content"] in ("<|im_end|>", "<|return|>",
                                                                        "<|endoftext|>")), 0)
    return out, special, eos


def timed(f):
    t = time.perf_counter()
    out = f()
    return out, time.perf_counter() - t


def report(name, compile_s, mask_s, failures, extra=""):
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")
    print(f"{name:13s} compile ms: median {1e3 * q(compile_s, .5):8.2f} p90 {1e3 * q(compile_s, .9):8.2f} "
          f"max {1e3 * max(compile_s or [0]):8.1f} | mask us: median {1e6 * q(mask_s, .5):7.1f} "
          f"p99 {1e6 * q(mask_s, .99):8.1f} | failed {len(failures)}{extra}")
    for f in failures[:3]:
        print(f"    {f}")


def walk(rng, allowed_of, consume, done, steps=STEPS):
    """Times the mask along a random completion of up to `steps` tokens: allowed_of() -> (the
    allowed ids, the seconds the library took to give them, unpacking apart)."""
    out = []
    for _ in range(steps):
        if done():
            break
        allowed, dt = allowed_of()
        out.append(dt)
        if len(allowed) == 0:
            break
        consume(int(rng.choice(allowed)))
    return out


def bits(mask: np.ndarray, n: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n])


def run_llguidance(tj, schemas, V, eos):
    import llguidance as llg
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok, dt = timed(lambda: llg.LLTokenizer(tj, n_vocab=V, eos_token=eos))
    print(f"llguidance: tokenizer built in {dt:.2f} s")
    comp, masks, fail = [], [], []
    rng = np.random.default_rng(0)
    opts = {"whitespace_flexible": False}
    for s in schemas:
        m, dt = timed(lambda: llg.LLMatcher(tok, llg.LLMatcher.grammar_from_json_schema(s, overrides=opts)))
        if m.is_error():
            fail.append(m.get_error()[:120])
            continue
        comp.append(dt)
        bm = allocate_token_bitmask(1, V)

        def allowed():
            _, dt = timed(lambda: fill_next_token_bitmask(m, bm))
            return bits(bm, V), dt
        masks += walk(rng, allowed, m.consume_token, m.is_stopped)
    report("llguidance", comp, masks, fail)


def run_xgrammar(tokens, schemas, V, eos):
    import torch
    import xgrammar as xgr

    info, dt = timed(lambda: xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    print(f"xgrammar: tokenizer info in {dt:.2f} s")
    comp, masks, fail = [], [], []
    rng = np.random.default_rng(0)
    for s in schemas:
        try:
            g, dt = timed(lambda: compiler.compile_json_schema(json.dumps(s), any_whitespace=False))
        except Exception as e:  # noqa: BLE001 - the library's own error, reported
            fail.append(f"{type(e).__name__}: {str(e)[:120]}")
            continue
        comp.append(dt)
        m = xgr.GrammarMatcher(g)
        bm = xgr.allocate_token_bitmask(1, V)

        def allowed():
            _, dt = timed(lambda: m.fill_next_token_bitmask(bm, 0))
            return bits(bm.numpy(), V), dt
        masks += walk(rng, allowed, m.accept_token, m.is_terminated)
    del torch
    report("xgrammar", comp, masks, fail)


def run_outlines(tokens, special, schemas, V, eos):
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(tokens):
        if i != eos and i not in special and b:
            table.setdefault(b, []).append(i)
    vocab, dt = timed(lambda: Vocabulary(eos, table))
    print(f"outlines-core: vocabulary in {dt:.2f} s")
    comp, masks, fail, states, trans = [], [], [], [], []
    rng = np.random.default_rng(0)
    for s in schemas:
        try:
            index, dt = timed(lambda: Index(build_regex_from_schema(json.dumps(s), r"[ ]?"), vocab))
        except Exception as e:  # noqa: BLE001
            fail.append(f"{type(e).__name__}: {str(e)[:120]}")
            continue
        comp.append(dt)
        t = index.get_transitions()
        states.append(len(t))
        trans.append(sum(len(x) for x in t.values()))
        state = [index.get_initial_state()]

        def allowed():  # a list of ids; a bitmask for the device would cost more
            ids, dt = timed(lambda: index.get_allowed_tokens(state[0]))
            return np.asarray(ids or []), dt

        def consume(tok):
            state[0] = index.get_next_state(state[0], tok)
        masks += walk(rng, allowed, consume, lambda: state[0] is None or index.is_final_state(state[0]))
    extra = (f" | automaton: states median {int(statistics.median(states))} max {max(states)}, "
             f"transitions median {int(statistics.median(trans))} max {max(trans)}; dense [states, V] "
             f"int32 median {statistics.median(states) * V * 4 / 2**20:.0f} MiB") if states else ""
    report("outlines-core", comp, masks, fail, extra)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="a folder holding tokenizer.json")
    p.add_argument("--schemas", type=int, default=100)
    p.add_argument("--libs", default="llguidance,xgrammar,outlines")
    a = p.parse_args()
    path = os.path.expanduser(a.tokenizer)
    path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(path):
        path = sorted(glob.glob(os.path.join(os.path.dirname(path), "*.json")))[-1]
    tj = open(path, encoding="utf-8").read()
    tokens, special, eos = token_bytes(tj)
    V = len(tokens)
    rows = [json.loads(line) for line in open(CASES, encoding="utf-8")]
    schemas = [r["schema"] for r in rows if r["kind"] == "json_schema"][: a.schemas]
    print(f"{path}: {V} tokens, {len(schemas)} schemas")
    for lib in a.libs.split(","):
        {"llguidance": lambda: run_llguidance(tj, schemas, V, [eos]),
         "xgrammar": lambda: run_xgrammar(tokens, schemas, V, eos),
         "outlines": lambda: run_outlines(tokens, special, schemas, V, eos)}[lib]()


if __name__ == "__main__":
    main()
