"""A chat job of widely varied prompt and answer lengths, for whole-job comparisons (one commit of
podrun against another, podrun against llama-server), never used to tune either.

    python benchmarks/varied_chat.py TEXT.txt OUT.jsonl [N=128] [SEED=23]

A quarter each, in a shuffled order:
- one of two long shared system prompts (a persona and its rules, ~250 and ~400 tokens), then a
  short question: prefix sharing's case;
- one of two few-shot prefixes (4 or 8 question/answer pairs from the text), then a new question;
- a task over a passage of TEXT of 100 to 3,200 characters (~30 to ~900 tokens), uniform;
- a short question alone.
max_tokens from 16 to 384 (log-uniform), temperature 0.7 / top_p 0.9 with a seed on half of
them, greedy on the other half, so answers end at their end of turn or their limit at very
different lengths. Prompts need max_prompt_len 1024, answers max_new_tokens 384.
"""

from __future__ import annotations

import json
import math
import random
import sys

QUESTIONS = ["What is the boiling point of water at sea level?", "Write two lines about the moon.",
             "How many legs does a spider have?", "Give me three tips for a job interview.",
             "What causes the seasons?", "Explain what a prime number is.", "Suggest a name for a cat.",
             "Write a short poem about autumn leaves.", "What is the capital of Japan?",
             "How do plants make food?", "Describe the taste of a lemon.", "What is 7 times 8?",
             "Why is the sky blue?", "List four musical instruments.", "What does DNA stand for?",
             "Write a sentence using the word 'gleam'."]
TASKS = ["Summarize this passage in two sentences:\n\n{p}", "What is the mood of this passage?\n\n{p}",
         "Rewrite the first lines of this passage as a modern news headline:\n\n{p}",
         "Which words in this passage are unusual today? List a few.\n\n{p}",
         "Continue this passage with two more lines in the same style:\n\n{p}"]


def system_prompt(text: str, rng: random.Random, words: int) -> str:
    """A persona with rules, padded to about `words` words with lines of TEXT as examples of
    style."""
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) > 5]
    out = ["You are Quill, a careful assistant for a theatre company. Follow these rules:",
           "1. Answer briefly and plainly. 2. Never invent facts. 3. Keep a courteous tone.",
           "4. When asked about the plays, quote them exactly. Examples of the company's style:"]
    while sum(len(x.split()) for x in out) < words:
        out.append(rng.choice(lines))
    return "\n".join(out)


def few_shot(text: str, rng: random.Random, pairs: int) -> str:
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) > 4]
    out = []
    for _ in range(pairs):
        line = rng.choice(lines)
        out.append(f"Q: How many words are in the line \"{line}\"?\nA: {len(line.split())}")
    return "\n\n".join(out)


def main(argv: list[str]) -> None:
    text = open(argv[1], encoding="utf-8").read()
    out, n = argv[2], int(argv[3]) if len(argv) > 3 else 128
    rng = random.Random(int(argv[4]) if len(argv) > 4 else 23)
    systems = [system_prompt(text, rng, 180), system_prompt(text, rng, 300)]
    shots = [few_shot(text, rng, 4), few_shot(text, rng, 8)]
    kinds = [i % 4 for i in range(n)]
    rng.shuffle(kinds)
    with open(out, "w") as f:
        for i, kind in enumerate(kinds):
            if kind == 0:
                messages = [{"role": "system", "content": rng.choice(systems)},
                            {"role": "user", "content": rng.choice(QUESTIONS)}]
            elif kind == 1:
                line = rng.choice([ln for ln in text.splitlines() if len(ln.split()) > 4]).strip()
                messages = [{"role": "user", "content": rng.choice(shots)
                             + f"\n\nQ: How many words are in the line \"{line}\"?\nA:"}]
            elif kind == 2:
                size = rng.randint(100, 3200)
                start = rng.randrange(0, len(text) - size)
                messages = [{"role": "user",
                             "content": rng.choice(TASKS).format(p=text[start: start + size].strip())}]
            else:
                messages = [{"role": "user", "content": rng.choice(QUESTIONS)}]
            request = {"id": f"v{i:04d}", "messages": messages,
                       "max_tokens": int(math.exp(rng.uniform(math.log(16), math.log(384))))}
            if i % 2 == 0:
                request.update(temperature=0.7, top_p=0.9, seed=i)
            f.write(json.dumps(request) + "\n")
    print(f"wrote {n} requests to {out}")


if __name__ == "__main__":
    main(sys.argv)
