"""Host time to read one chat request line into prompt ids (runner.api.podrun.parse_line), with
and without tools, in the Harmony format on o200k_harmony (GPT-OSS's), as runner.job reads them.

    python benchmarks/chat_render.py [--reps=300] [--rounds=5]

The chats are tests/test_tools.py's (7 messages with two calls and their results; 3 tools). Prints
the median over rounds of the mean milliseconds per line, per case. The vocabulary comes from the
bpe-openai wheel (fetched into ~/.cache/podrun on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=300, help="lines read per round and case")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from configs.cpu import get_config
    from runner.text.chat import chat_format
    from runner.api.common import Line
    from runner.api.podrun import parse_line
    from runner.settings import from_config
    from runner.text import o200k
    from runner.text.tokenizer import load_tokenizer
    from tests.test_tools import CONVERSATIONS, TOOLS

    c = get_config("/unused")
    c.generation.max_prompt_len = 8192
    s = from_config(c)
    folder = tempfile.mkdtemp()
    o200k.write_tokenizer_files(folder)
    tok = load_tokenizer(folder)
    render = chat_format("gptoss", tok, s.generation.reasoning_effort)
    chat = CONVERSATIONS["calls_across_turns"]
    cases = {"no tools": {"messages": chat}, "3 tools": {"messages": chat, "tools": TOOLS},
             "3 tools, tool_choice required": {"messages": chat, "tools": TOOLS, "tool_choice": "required"}}
    for name, request in cases.items():
        line = Line(1, json.dumps(request))
        p = parse_line(0, line, tok, s, o200k.VOCAB_SIZE, render)
        assert not p.error, p.error
        means = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.reps):
                parse_line(0, line, tok, s, o200k.VOCAB_SIZE, render)
            means.append((time.perf_counter() - t0) / args.reps * 1e3)
        print(f"{name}: {statistics.median(means):.3f} ms per line ({len(p.prompt_ids)} prompt tokens)")


if __name__ == "__main__":
    main()
