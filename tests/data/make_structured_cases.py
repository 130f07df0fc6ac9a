"""Writes tests/data/structured_cases.jsonl: the held-out constraints of tests/test_structured.py
and benchmarks/structured.py, 100 JSON schemas, 100 regexes and 100 choice lists, drawn from a
fixed seed. Bounded (maxLength, maxItems, number ranges) so that a completion fits in a few
hundred tokens whatever the model prefers.

    python tests/data/make_structured_cases.py
"""

import json
import os
import random

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "north", "south", "cat", "dog",
         "yes", "no", "maybe", "Paris", "Lyon", "Tokyo", "fast", "slow", "é-accent", "日本"]
PATTERNS = [r"[a-z]{2,6}", r"[A-Z][a-z]{1,5}", r"\d{3}-\d{4}", r"[0-9a-f]{4,8}", r"(foo|bar)\d",
            r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)", r"v\d\.\d{1,2}", r"[A-Z]{3}"]


def leaf(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "pattern", "array",
                       "object", "const", "nullable"] if depth < 2 else
                      ["string", "integer", "number", "boolean", "enum", "pattern"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -1000, "maximum": 1000}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 5))}
    if kind == "pattern":
        return {"type": "string", "pattern": "^" + rng.choice(PATTERNS) + "$"}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "nullable":
        return {"anyOf": [{"type": "null"}, leaf(rng, 2)]}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": leaf(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    return obj(rng, depth + 1)


def obj(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "age", "city", "tags", "score", "ok", "kind", "items",
                        "meta", "code", "when", "x", "y"], rng.randint(1, 4))
    props = {n: leaf(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    out = {"type": "object", "properties": props, "required": required,
           "additionalProperties": False}
    return out


def main() -> None:
    rng = random.Random(33)
    rows = [{"kind": "json_schema", "schema": obj(rng, 0)} for _ in range(100)]
    for _ in range(100):
        parts = rng.sample(PATTERNS, rng.randint(1, 3))
        rows.append({"kind": "regex", "regex": rng.choice([" ", "-", ":", ""]).join(parts)})
    for _ in range(100):
        choices = rng.sample(WORDS, rng.randint(2, 6))
        if rng.random() < 0.3:  # one a prefix of another: the completion must still end exactly
            choices.append(choices[0] + rng.choice(["s", " too", "-x"]))
        rows.append({"kind": "choice", "choices": choices})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "structured_cases.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
