"""The request parser and the result writer under generated input (hypothesis): random bytes,
random JSON, requests with fields of the wrong types, huge numbers, deep nesting and long lines.
Every non-blank line gets exactly one result or one-line error, nothing raises, and what is
written reads back as JSON, in input order, across a restart."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner.api.common import INT32_MAX, Line, read_lines
from runner.api.podrun import FIELDS, parse_line
from runner.errors import RequestFileError
from runner.results.writer import Results
from runner.text.structured import Grammars
from runner.text.tokenizer import load_tokenizer
from tests import test_tokenizer

bpe_folder = test_tokenizer.bpe_folder  # a fixture: a BPE tokenizer with a chat template
VOCAB_SIZE = 400


@pytest.fixture(scope="module")
def tok(bpe_folder):
    return load_tokenizer(bpe_folder)


@pytest.fixture(scope="module")
def grammars(tok):
    return Grammars(tok, VOCAB_SIZE, tok.eos_token_ids)


@pytest.fixture(scope="module")
def s():
    from configs.cpu import get_config
    from runner.settings import from_config

    c = get_config("/unused")
    c.generation.max_prompt_len, c.generation.max_new_tokens = 64, 16
    return from_config(c)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "robot"]) | st.integers(),
     "content": st.text(max_size=40) | json_values},
    optional={"tool_calls": json_values | st.lists(st.fixed_dictionaries(
        {"id": st.sampled_from(["c1", "c2"]) | json_values, "type": st.just("function") | json_values,
         "function": st.fixed_dictionaries({"name": st.text(max_size=8) | json_values,
                                            "arguments": st.sampled_from(["{}", '{"a": 1}', "{", "[]"])
                                            | json_values})}), max_size=2),
              "tool_call_id": st.sampled_from(["c1", "c2"]) | json_values}), max_size=3)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | json_values, "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "a b"]) | json_values},
    optional={"description": st.text(max_size=10) | json_values,
              "parameters": st.just({"type": "object"}) | st.just({"type": "objekt"}) | json_values})}),
    max_size=2)
field_values = {
    "id": json_values, "prompt": st.text(max_size=80) | json_values, "messages": messages | json_values,
    "prompt_token_ids": st.lists(st.integers(-10, VOCAB_SIZE + 10) | st.integers(), max_size=80) | json_values,
    "max_tokens": st.integers(-3, 40) | json_values, "temperature": st.floats() | json_values,
    "top_p": st.floats() | json_values, "top_k": st.integers() | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | json_values,
    "seed": st.integers() | json_values, "reasoning_effort": st.sampled_from(["low", "max"]),
    "n": st.integers(-2, 200) | json_values, "logprobs": st.integers(-2, 25) | st.booleans() | json_values,
    "top_logprobs": st.integers(-2, 25) | json_values, "prompt_logprobs": st.integers(-2, 25) | json_values,
    "continuation": st.text(max_size=20) | st.lists(st.integers(-10, VOCAB_SIZE + 10), max_size=8) | json_values,
    "tools": tools | json_values, "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "text"])
                                              | json_values},
                                             optional={"json_schema": st.fixed_dictionaries(
                                                 {"schema": json_values})}) | json_values,
    "guided_json": json_values | json_values.map(json.dumps), "guided_regex": st.text(max_size=12) | json_values,
    "guided_choice": st.lists(st.text(max_size=6), max_size=3) | json_values,
    "max_tokenz": json_values, "": json_values}
requests = st.fixed_dictionaries({}, optional=field_values)
lines = st.one_of(
    requests.map(json.dumps),
    json_values.map(json.dumps),
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b" ").decode("utf-8", "surrogateescape")),
    st.text(max_size=60).map(lambda t: t.replace("\n", " ")),
    st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 200_000).map(lambda n: json.dumps({"prompt_token_ids": [1] * n})),
)


def problems(p, s) -> list[str]:
    """What is wrong with a parsed line ([] when nothing): it must be a one-line error, or a
    request that fits the deployment."""
    if p.error:
        ok = isinstance(p.error, str) and "\n" not in p.error and len(p.error) < 500
        return [] if ok else [f"error {p.error!r} is not one short line"]
    g = s.generation
    checks = {
        "prompt length": 0 < len(p.prompt_ids) <= g.max_prompt_len,
        "prompt ids in the vocabulary": all(isinstance(i, int) and 0 <= i < VOCAB_SIZE
                                            for i in p.prompt_ids),
        "max_tokens": (1 if p.prompt_logprobs is None and not p.continuation else 0)
                      <= p.max_tokens <= g.max_new_tokens,
        "n": 1 <= p.n <= 128,
        "logprobs": all(k is None or 0 <= k <= 20 for k in (p.logprobs, p.prompt_logprobs)),
        "continuation": 0 <= p.continuation < len(p.prompt_ids),
        "temperature": math.isfinite(p.temperature) and p.temperature >= 0,
        "top_p and top_k": 0 < p.top_p <= 1 and 0 <= p.top_k <= INT32_MAX,
        "seed": 0 <= p.seed < 2**32,
        "stop strings": all(isinstance(x, str) and x for x in p.stop),
    }
    return [name for name, ok in checks.items() if not ok]


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(line=lines, number=st.integers(1, 10**6))
def test_any_line_gets_one_result(tok, s, grammars, line, number):
    p = parse_line(0, Line(number, line), tok, s, VOCAB_SIZE, grammars=grammars)
    assert not problems(p, s), (p, problems(p, s))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(request=requests)
def test_requests_without_a_tokenizer(s, request):
    p = parse_line(0, Line(1, json.dumps(request)), None, s, VOCAB_SIZE)
    assert not problems(p, s), (p, problems(p, s))


def test_fields_and_typos_are_named(tok, s):
    def error(d):
        return parse_line(0, Line(3, json.dumps(d)), tok, s, VOCAB_SIZE).error

    assert error({"prompt": "hi", "max_tokenz": 3}) == "unknown field 'max_tokenz': did you mean 'max_tokens'?"
    assert error({"prompt": "hi", "xyzzy": 3}) == "unknown field 'xyzzy': request fields are " + ", ".join(FIELDS)
    assert error({"prompt_token_ids": [5, 400]}) == (
        "prompt_token_ids[1]=400 is outside the vocabulary of 400 ids (0 to 399)")
    for stop in (5, 0, False, "", [""], ["a", 1]):
        assert error({"prompt": "hi", "stop": stop}) == (
            f"stop={json.dumps(stop)}: give a non-empty string or a list of them")
    assert error({"prompt": "hi", "stop": None}) == error({"prompt": "hi", "stop": []}) == ""
    # refused whatever the template would do with it (this one raises, SmolLM2's renders any name)
    assert error({"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}]}) == (
        'messages[1].role="wizard" is not a chat role: give one of system, developer, user, assistant, tool')
    # a value out of range names the range it must be in
    assert error({"prompt": "hi", "n": 200}) == "n=200 is out of range: give an integer from 1 to 128"
    assert error({"prompt": "hi", "top_p": 0}) == (
        "top_p=0 is out of range: give a number above 0 and at most 1")
    assert error({"prompt": "hi", "temperature": -1}) == (
        "temperature=-1 is out of range: give a number at least 0")
    assert error({"prompt": "hi", "logprobs": 21}) == "logprobs=21 is out of range: give an integer from 0 to 20"


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.lists(lines | st.just("") | st.just("   \r"), min_size=1, max_size=25), cut=st.integers(0, 30),
       crlf=st.booleans())
def test_the_writer_keeps_every_line_in_order_across_a_restart(tok, s, tmp_path_factory, body, cut, crlf):
    """Each non-blank line gets one result line, in order; results written before a restart are
    kept, and the rest added after it."""
    folder = tmp_path_factory.mktemp("w")
    end = "\r\n" if crlf else "\n"
    data = end.join(body).encode("utf-8", "surrogateescape")
    (folder / "in.jsonl").write_bytes(data)
    # a line ends at \n; a \r before it goes (the line's own last \r too, where it has one)
    texts = [t if crlf and n < len(body) else t.removesuffix("\r") for n, t in enumerate(body, 1)]
    texts[0] = texts[0].removeprefix("\ufeff")  # a byte-order mark opening the file is dropped
    if not any(t.strip() for t in texts):
        with pytest.raises(RequestFileError, match="holds no requests"):
            read_lines(str(folder / "in.jsonl"))
        return
    got = read_lines(str(folder / "in.jsonl"))
    assert [(x.number, x.text) for x in got] == [(n, t) for n, t in enumerate(texts, 1) if t.strip()]
    out = str(folder / "out.jsonl")

    def answer(results, indices):
        rows = []
        for i in indices:
            p = parse_line(i, got[i], tok, s, VOCAB_SIZE)
            assert not problems(p, s), (p, problems(p, s))
            text = tok.decode(list(p.prompt_ids)) if not p.error else ""
            rows.append((i, {"id": p.id, "error": p.error} if p.error else {"id": p.id, "text": text}))
        results.add(rows)

    first = Results(out, got)
    first.open()
    answer(first, range(min(cut, len(got))))  # then the process dies: no finish
    second = Results(out, got)
    assert sorted(second.done) == list(range(min(cut, len(got))))
    second.open()
    answer(second, [i for i in range(len(got)) if i not in second.done])
    second.write_final(len(got))
    with open(out, encoding="utf-8") as f:
        written = [json.loads(x) for x in f.read().split("\n") if x]
    assert len(written) == len(got)
    for line, r in zip(got, written):
        p = parse_line(0, line, tok, s, VOCAB_SIZE)
        assert json.dumps(r["id"]) == json.dumps(p.id)  # NaN too
        assert ("error" in r) == bool(p.error)
