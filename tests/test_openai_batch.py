"""OpenAI Batch files: bodies mapped onto podrun's requests, bad lines named, results in the shapes
of the `openai` package's types; end to end, vLLM's own example files through `runner.main`, a
run killed and restarted that answers every custom_id exactly once, and chats with tools, calls
and results on GPT-OSS (openai-harmony) and a Qwen2.5 chat template (transformers)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion
from scipy.special import log_softmax

from runner.api import common, formats, openai_batch
from runner.api import podrun as podrun_format
from runner.api.common import Answer, Choice, Line, Parsed, Token
from runner.api.formats import FileFormat, file_format, parse_line
from runner.engine import Completion as Sample
from runner.engine.sampling import MAX_LOGPROBS, TokenLogprobs
from runner.errors import RequestFileError
from runner.text.tokenizer import load_tokenizer
from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf
from tests.test_end_to_end import ROOT, podrun, read_jsonl, write_jsonl
from tests.test_requests import VOCAB_SIZE, json_values, problems
from tests import test_harmony, test_tokenizer, test_tools

# fixtures of other modules, bound here so that pytest finds them (module-scoped: built once here)
bpe_folder = test_tokenizer.bpe_folder  # a BPE tokenizer with a chat template
vocab_dir, enc = test_harmony.vocab_dir, test_harmony.enc  # openai-harmony's encoding

DATA = os.path.join(os.path.dirname(__file__), "data", "openai_batch")
BATCH = FileFormat(True, 1)


@pytest.fixture(scope="module")
def tok(bpe_folder):
    return load_tokenizer(bpe_folder)


@pytest.fixture(scope="module")
def s():
    from configs.cpu import get_config
    from runner.settings import from_config

    c = get_config("/unused")
    c.generation.max_prompt_len, c.generation.max_new_tokens = 64, 16
    return from_config(c)

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be?"}]}


def batch_line(body, url="/v1/chat/completions", custom_id="c1", **envelope):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **envelope})


def parsed(tok, s, text, number=4, fmt=BATCH):
    return parse_line(0, Line(number, text), fmt, tok, s, VOCAB_SIZE)


def fields(p: Parsed) -> dict:
    """What the engine is given: every field but the result's id and shape."""
    d = dict(vars(p))
    del d["id"], d["api"]
    return d


# --- input ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, equivalent", [
    # vLLM's example lines: the model named is not the deployment's and is not checked
    ({"model": "meta-llama/Meta-Llama-3-8B-Instruct", **CHAT, "max_completion_tokens": 7}, {**CHAT, "max_tokens": 7}),
    ({**CHAT, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "n": 2, "stop": "x", "seed": 9,
      "logprobs": True, "top_logprobs": 3},
     {**CHAT, "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "n": 2, "stop": "x", "seed": 9,
      "logprobs": True, "top_logprobs": 3}),
    ({**CHAT, "user": "u1", "stream": False, "stream_options": None, "store": False, "metadata": {"a": "b"},
      "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "parallel_tool_calls": True},
     CHAT),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "To"}, {"type": "text", "text": "be?"}]}]},
     {"messages": [{"role": "user", "content": "To\nbe?"}]}),
])
def test_chat_bodies_make_the_requests_podrun_lines_make(tok, s, body, equivalent):
    p = parsed(tok, s, batch_line(body))
    want = podrun_format.parse_line(0, Line(4, json.dumps(equivalent)), tok, s, VOCAB_SIZE)
    assert not p.error and not want.error, (p.error, want.error)
    assert (p.id, p.api) == ("c1", "chat.completion")
    assert fields(p) == fields(want)


@pytest.mark.parametrize("body, equivalent", [
    ({"model": "x", "prompt": "To be, or not", "max_tokens": 5, "logprobs": 2, "echo": False, "best_of": 1,
      "suffix": None}, {"prompt": "To be, or not", "max_tokens": 5, "logprobs": 2}),
    ({"prompt": [5, 6, 7]}, {"prompt_token_ids": [5, 6, 7]}),
    ({"prompt": [[5, 6, 7]], "stop": ["a", "b"]}, {"prompt_token_ids": [5, 6, 7], "stop": ["a", "b"]}),
    ({"prompt": ["To be"]}, {"prompt": "To be"}),
])
def test_completion_bodies_make_the_requests_podrun_lines_make(tok, s, body, equivalent):
    p = parsed(tok, s, batch_line(body, url="/v1/completions"))
    want = podrun_format.parse_line(0, Line(4, json.dumps(equivalent)), tok, s, VOCAB_SIZE)
    assert not p.error and not want.error, (p.error, want.error)
    assert (p.id, p.api) == ("c1", "text_completion")
    assert fields(p) == fields(want)


CHAT_URL, TEXT_URL = "/v1/chat/completions", "/v1/completions"
BAD = [  # (line, the start of its error, the param named)
    (json.dumps({"method": "POST", "url": CHAT_URL, "body": CHAT}), "custom_id is missing", "custom_id"),
    (batch_line(CHAT, custom_id=7), "custom_id=7 is not a string", "custom_id"),
    (batch_line(CHAT, extra=1), "unknown field \"extra\"", "extra"),
    (batch_line(CHAT, method="GET"), "method=\"GET\": Batch requests are POST", "method"),
    (batch_line(CHAT, url="/v1/embeddings"), "url=\"/v1/embeddings\" is not served", "url"),
    (batch_line([CHAT]), "body=[", "body"),
    (batch_line({**CHAT, "stream": True}), "stream=true: a Batch request is answered whole", "stream"),
    (batch_line({**CHAT, "stream": "True"}), "stream=\"True\"", "stream"),
    (batch_line({**CHAT, "temperature": "hot"}), "temperature=\"hot\" is not a number", "temperature"),
    (batch_line({**CHAT, "max_completion_tokens": 99}), "max_completion_tokens=99 exceeds generation.max_new_tokens",
     "max_completion_tokens"),
    (batch_line({**CHAT, "max_completion_tokens": 2, "max_tokens": 3}), "max_completion_tokens=2 and max_tokens=3",
     "max_completion_tokens"),
    (batch_line({**CHAT, "max_tokenz": 3}), "unknown body field \"max_tokenz\" for /v1/chat/completions: did you "
     "mean 'max_tokens'?", "max_tokenz"),
    (batch_line({**CHAT, "logprobs": 3}), "logprobs=3: a boolean in chat completions", "logprobs"),
    (batch_line({**CHAT, "presence_penalty": 0.5}), "presence_penalty=0.5 is not supported", "presence_penalty"),
    (batch_line({**CHAT, "prompt": "x"}), "body field \"prompt\" belongs to /v1/completions", "prompt"),
    (batch_line({"messages": "hi"}), "messages must be a non-empty list", "messages"),
    (batch_line({"max_tokens": 3}), "messages is missing", "messages"),
    (batch_line({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}),
     "tools[0].function.parameters is not a JSON schema", "tools"),
    (batch_line({**CHAT, "response_format": {"type": "xml"}}), "response_format={\"type\": \"xml\"}: give",
     "response_format"),
    (batch_line({**CHAT, "guided_choice": []}), "guided_choice=[]: give a non-empty list", "guided_choice"),
    (batch_line({"prompt": "x", "logprobs": True}, url=TEXT_URL), "logprobs=true: a count", "logprobs"),
    (batch_line({"prompt": "x", "top_logprobs": 2}, url=TEXT_URL), "body field \"top_logprobs\" belongs to "
     "/v1/chat/completions", "top_logprobs"),
    (batch_line({"prompt": ["a", "b"]}, url=TEXT_URL), "prompt holds 2 prompts", "prompt"),
    (batch_line({"prompt": {"a": 1}}, url=TEXT_URL), "prompt={\"a\": 1}: give a string or a list of token ids",
     "prompt"),
    (batch_line({"prompt": [5, 999]}, url=TEXT_URL), "prompt[1]=999 is outside the vocabulary", "prompt"),
    (batch_line({"prompt": "x", "echo": True}, url=TEXT_URL), "echo=true is not supported", "echo"),
    (batch_line({"messages": CHAT["messages"]}, url=TEXT_URL), "body field \"messages\" belongs to", "messages"),
    (json.dumps({"id": "a", "prompt": "x"}), "line 4 is podrun's format, but the file's first request (line 1) is "
     "an OpenAI Batch request (custom_id, method, url, body): give one format per file", None),
    ("{not json", "line 4 is not valid JSON", None),
]


@pytest.mark.parametrize("line, error, param", BAD)
def test_bad_batch_lines_get_an_error_naming_the_field(tok, s, line, error, param):
    p = parsed(tok, s, line)
    assert p.error.startswith(error), p.error
    out = openai_batch.error_line(p)
    assert out["error"]["param"] == param and out["error"]["message"] == p.error
    assert out["response"]["status_code"] == 400
    batch_error = openai.types.BatchError.model_validate(out["error"])  # OpenAI's type: a string code
    assert batch_error.line == 4
    assert batch_error.code == ("invalid_json" if "not valid JSON" in p.error else
                                "unknown_parameter" if "unknown" in p.error or "belongs to" in p.error
                                else "invalid_request")
    assert out["custom_id"] == p.id
    assert p.id == (json.loads(line).get("custom_id") if "is not a string" not in error and line[0] == "{"
                    and "podrun's format" not in error and "not valid JSON" not in error else None)


def test_a_batch_line_in_a_podrun_file_is_named():
    fmt = file_format([Line(2, "  "), Line(3, "[1]"), Line(5, json.dumps({"prompt": "x"}))])
    assert fmt == FileFormat(False, 5)
    p = parse_line(0, Line(9, batch_line(CHAT)), fmt, None, None, VOCAB_SIZE)
    assert p.error == ("line 9 is an OpenAI Batch request (custom_id, method, url, body), but the file's first "
                       "request (line 5) is podrun's format: give one format per file")
    assert p.id == 9


def test_duplicate_custom_ids_are_refused_with_their_lines():
    lines = [Line(n, batch_line(CHAT, custom_id=c)) for n, c in ((1, "a"), (2, "b"), (4, "a"), (5, "c"), (7, "a"),
                                                                 (8, "c"))]
    with pytest.raises(RequestFileError, match=r'2 custom_id\(s\) given more than once.*"a" on lines 1, 4, 7; '
                                               r'"c" on lines 5, 8$'):
        file_format(lines)
    assert file_format(lines[:2]) == FileFormat(True, 1)


def test_repeated_ids_in_podrun_format_are_refused_like_custom_ids():
    """Results are matched to requests by id: a repeated id would answer two requests under one."""
    lines = [Line(n, json.dumps({"id": i, "prompt": "x"})) for n, i in ((1, "a"), (2, 7), (3, "b"), (4, 7),
                                                                        (6, "a"))]
    with pytest.raises(RequestFileError, match=r'2 id\(s\) given more than once.*"a" on lines 1, 6; '
                                               r'7 on lines 2, 4$'):
        file_format(lines)
    # ids left to their line numbers never repeat, and "7" the string is not 7 the number
    free = [Line(1, json.dumps({"prompt": "x"})), Line(2, json.dumps({"prompt": "y"})),
            Line(3, json.dumps({"id": "7", "prompt": "x"})), Line(4, json.dumps({"id": 7, "prompt": "x"}))]
    assert file_format(free) == FileFormat(False, 1)


def test_an_id_equal_to_the_line_number_another_line_takes_is_refused_in_either_order():
    """A line without an id (or that is not a JSON object) is answered under its line number: an
    id given on another line equal to it would answer two requests under one id."""
    rows = {"x": json.dumps({"prompt": "x"}), 2: json.dumps({"id": 2, "prompt": "y"})}
    first_given = [Line(1, rows[2]), Line(2, rows["x"])]
    with pytest.raises(RequestFileError) as e:
        file_format(first_given)
    assert str(e.value) == ("io.input: 1 id(s) given more than once, but each request needs its own: 2 on "
                            "lines 1, 2 (no id: its line number)")
    first_taken = [Line(2, "not JSON"), Line(3, rows["x"]), Line(5, json.dumps({"id": 3})), Line(6, rows[2])]
    with pytest.raises(RequestFileError) as e:
        file_format(first_taken)
    assert str(e.value) == ("io.input: 2 id(s) given more than once, but each request needs its own: 2 on "
                            "lines 2 (no id: its line number), 6; 3 on lines 3 (no id: its line number), 5")
    # no collision: "2" the string is not line 2's number, nor is 2.5; a null id is left as given
    fine = [Line(1, json.dumps({"id": 5})), Line(2, rows["x"]), Line(3, json.dumps({"id": "2"})),
            Line(4, json.dumps({"id": 2.5})), Line(6, json.dumps({"id": None})), Line(7, json.dumps({"id": None}))]
    assert file_format(fine) == FileFormat(False, 1)
    assert [formats.line_id(x, FileFormat(False, 1)) for x in fine] == [5, 2, "2", 2.5, None, None]


batch_lines = st.fixed_dictionaries(
    {}, optional={"custom_id": st.text(max_size=8) | json_values, "method": st.just("POST") | json_values,
                  "url": st.sampled_from([CHAT_URL, TEXT_URL, "/v1/embeddings"]) | json_values,
                  "body": st.fixed_dictionaries({}, optional={
                      "messages": st.just(CHAT["messages"]) | json_values, "prompt": st.text(max_size=20) | json_values,
                      "max_tokens": st.integers(-2, 40) | json_values, "max_completion_tokens": json_values,
                      "logprobs": st.booleans() | st.integers(-1, 25) | json_values, "top_logprobs": json_values,
                      "stream": json_values, "n": json_values, "stop": json_values, "model": json_values,
                      "tools": json_values, "echo": json_values, "suffix": json_values}) | json_values})


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(d=batch_lines, number=st.integers(1, 10**6))
def test_any_batch_line_gets_a_request_or_a_one_line_error(tok, s, d, number):
    p = parse_line(0, Line(number, json.dumps(d)), BATCH, tok, s, VOCAB_SIZE)
    assert not problems(p, s), (p, problems(p, s))
    assert p.error or (p.api and isinstance(p.id, str))
    out = openai_batch.error_line(p) if p.error else None
    assert out is None or json.loads(json.dumps(out)) == out


def read(name: str) -> list[Line]:
    return [Line(n, t) for n, t in enumerate(open(os.path.join(DATA, name), encoding="utf-8").read().split("\n"), 1)
            if t.strip()]


def test_vllm_test_files_get_their_errors_per_line(tok, s):
    """vLLM's run-batch test inputs (tests/data/openai_batch/README.md): a bad url and stream
    "True" get errors; a model name podrun does not serve is answered by the deployment; a line
    without its custom_id gets an error, and the next line its answer."""
    s = dataclasses.replace(s, generation=dataclasses.replace(s.generation, max_new_tokens=1000))

    def run(name):
        lines = read(name)
        fmt = file_format(lines)
        assert fmt == BATCH
        return [parse_line(i, x, fmt, tok, s, VOCAB_SIZE) for i, x in enumerate(lines)]

    ps = run("vllm_run_batch_input.jsonl")
    assert [p.id for p in ps] == [f"request-{i}" for i in range(1, 6)]
    assert [p.error.split(" is ")[0].split(":")[0] for p in ps] == ["", "", "", 'url="/bad_url"', 'stream="True"']
    assert all(p.max_tokens == 1000 for p in ps[:3])
    ps = run("vllm_run_batch_invalid_input.jsonl")
    assert ps[0].error.startswith("custom_id is missing") and ps[0].id is None
    assert not ps[1].error and ps[1].id == "request-2"
    ps = run("vllm_run_batch_reasoning.jsonl")
    assert not any(p.error for p in ps) and all(p.max_tokens == 1000 for p in ps)


# --- output -----------------------------------------------------------------------------------------

def check_envelope(line: dict, custom_id) -> dict | None:
    """A Batch output line's envelope, field by field (the openai package has no type for it);
    its response body, or None for an error line."""
    assert set(line) == {"id", "custom_id", "response", "error"} and line["custom_id"] == custom_id
    assert line["id"].startswith("batch_req_") and isinstance(line["id"], str)
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and isinstance(response["request_id"], str)
    if response["status_code"] == 200:
        assert line["error"] is None and isinstance(response["body"], dict)
        return response["body"]
    assert response["status_code"] == 400 and response["body"] is None
    e = line["error"]
    assert isinstance(e["message"], str) and "\n" not in e["message"]
    error = openai.types.BatchError.model_validate(e)
    assert error.code in ("invalid_request", "invalid_json", "unknown_parameter", "context_length_exceeded")
    assert isinstance(error.line, int) and error.line >= 1
    return None


def sample(ids, finish="length", seed=0):
    """A completion as the engine gives it, with made-up log-probabilities."""
    rng = np.random.RandomState(seed)
    logprobs = [TokenLogprobs(np.float32(-3 * rng.rand()), rng.permutation(VOCAB_SIZE)[:MAX_LOGPROBS],
                              np.sort(-5 * rng.rand(MAX_LOGPROBS)).astype(np.float32)[::-1]) for _ in ids]
    return Sample(list(ids), finish, logprobs=logprobs)


def test_chat_results_are_chat_completions(tok, s):
    body = {**CHAT, "n": 2, "logprobs": True, "top_logprobs": 3, "max_tokens": 5}
    p = parsed(tok, s, batch_line(body, custom_id="q-1"))
    ids = [tok.encode("To be or not", add_special_tokens=False)[:5], tok.encode("that is", add_special_tokens=False)]
    samples = [sample(ids[0], "length", 1), sample(ids[1], "stop", 2)]
    a = common.build_answer(p, samples, tok, False)
    out = openai_batch.result_line(p, a, "smollm2", 1_800_000_000)
    body = check_envelope(json.loads(json.dumps(out)), "q-1")
    c = ChatCompletion.model_validate(body)
    assert (c.object, c.model, c.created) == ("chat.completion", "smollm2", 1_800_000_000)
    assert [x.index for x in c.choices] == [0, 1]
    for x, sm, ids_ in zip(c.choices, samples, ids):
        assert x.message.role == "assistant" and x.message.content == tok.decode(ids_)
        assert x.finish_reason == sm.finish_reason
        assert [t.token for t in x.logprobs.content] == [tok.decode([i], skip_special_tokens=False) for i in ids_]
        assert [t.bytes for t in x.logprobs.content] == [list(t.token.encode()) for t in x.logprobs.content]
        assert [t.logprob for t in x.logprobs.content] == [float(lp.logprob) for lp in sm.logprobs]
        for t, lp in zip(x.logprobs.content, sm.logprobs):
            assert [a.token for a in t.top_logprobs] == [tok.decode([int(i)], skip_special_tokens=False)
                                                         for i in lp.top_ids[:3]]
            assert [a.logprob for a in t.top_logprobs] == [float(v) for v in lp.top_logprobs[:3]]
    assert c.usage.prompt_tokens == len(p.prompt_ids) and c.usage.completion_tokens == len(ids[0]) + len(ids[1])
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    again = openai_batch.result_line(p, a, "smollm2", 1_900_000_000)  # a rerun: the same ids
    assert (again["id"], again["response"]["request_id"], again["response"]["body"]["id"]) == (
        out["id"], out["response"]["request_id"], out["response"]["body"]["id"])
    other = openai_batch.result_line(parsed(tok, s, batch_line(CHAT, custom_id="q-2")), a, "smollm2", 0)
    assert len({other["id"], out["id"]}) == 2


def test_reasoning_and_tool_calls_reach_the_message(tok, s):
    """An answer's Harmony fields (`reasoning`) and tool calls become the message's
    reasoning_content and tool_calls; commentary and a broken format's error stay in the message
    under podrun's names. The answer is made by hand: the Batch line is written from it alone."""
    p = parsed(tok, s, batch_line(CHAT, custom_id="t"))
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    a = Answer("t", (Choice("", (5, 6), "tool_calls", reasoning="Look it up.", tool_calls=(call,)),), 9)
    body = check_envelope(openai_batch.result_line(p, a, "m", 0), "t")
    x = ChatCompletion.model_validate(body).choices[0]
    assert x.finish_reason == "tool_calls" and x.message.content is None and x.logprobs is None
    assert x.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(x.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert x.message.model_extra["reasoning_content"] == "Look it up."
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
    a = Answer("t", (Choice("Paris is sunny.", (7,), "length", commentary="(checking)",
                            chat_format_error="cut off in a message header", raw="<|channel|>x"),), 3)
    x = ChatCompletion.model_validate(check_envelope(openai_batch.result_line(p, a, "m", 0), "t")).choices[0]
    assert (x.finish_reason, x.message.content, x.message.tool_calls) == ("length", "Paris is sunny.", None)
    assert x.message.model_extra == {"commentary": "(checking)", "chat_format_error": "cut off in a message header",
                                     "raw": "<|channel|>x"}


def test_batch_lines_are_written_from_an_answer_alone(tok, s):
    """Answers made by hand, n = 2 with log-probabilities: a chat.completion and a
    text_completion of the openai package's types; a token without text (no tokenizer) is
    `token_id:<id>`, a log-probability of -inf is OpenAI's -9999.0, and io.echo_prompt's ids
    go in the body."""
    top = (Token(3, "é", -0.5), Token(4, None, -1.0))
    tokens = (Token(3, "é", -0.5, top), Token(4, None, float("-inf"), top[::-1]))
    a = Answer("x", (Choice("é!", (3, 4), "length", logprobs=tokens), Choice("", (), "stop", logprobs=())),
               5, prompt_token_ids=(1, 2, 3, 4, 5))
    chat = parsed(tok, s, batch_line(CHAT, custom_id="x"))
    body = check_envelope(openai_batch.result_line(chat, a, "m", 7), "x")
    c = ChatCompletion.model_validate(body)
    assert (c.object, c.model, c.created, [x.index for x in c.choices]) == ("chat.completion", "m", 7, [0, 1])
    assert [x.message.content for x in c.choices] == ["é!", ""]
    assert [x.finish_reason for x in c.choices] == ["length", "stop"]
    content = c.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in content] == [("é", -0.5, [0xC3, 0xA9]),
                                                                ("token_id:4", -9999.0, None)]
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in content] == [
        [("é", -0.5), ("token_id:4", -1.0)], [("token_id:4", -1.0), ("é", -0.5)]]
    assert c.choices[1].logprobs.content == []
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) == (5, 2, 7)
    assert body["prompt_token_ids"] == [1, 2, 3, 4, 5]
    text = parsed(tok, s, batch_line({"prompt": "x"}, url=TEXT_URL, custom_id="x"))
    body = check_envelope(openai_batch.result_line(text, a, "m", 7), "x")
    x = Completion.model_validate(body).choices[0]
    assert (body["object"], x.text, x.finish_reason) == ("text_completion", "é!", "length")
    assert x.logprobs.tokens == ["é", "token_id:4"] and x.logprobs.token_logprobs == [-0.5, -9999.0]
    assert x.logprobs.text_offset == [0, 1]
    assert x.logprobs.top_logprobs == [{"é": -0.5, "token_id:4": -1.0}, {"token_id:4": -1.0, "é": -0.5}]


def test_completion_results_are_text_completions_with_legacy_logprobs(tok, s):
    p = parsed(tok, s, batch_line({"prompt": "To be", "logprobs": 2, "max_tokens": 6}, url=TEXT_URL, custom_id="x"))
    ids = tok.encode(" or not to be", add_special_tokens=False)[:6]
    sm = sample(ids, "length", 3)
    out = openai_batch.result_line(p, common.build_answer(p, [sm], tok, False), "m", 5)
    c = Completion.model_validate(check_envelope(out, "x"))
    assert c.object == "text_completion" and c.usage.total_tokens == len(p.prompt_ids) + len(ids)
    (x,) = c.choices
    assert x.text == tok.decode(ids) and x.finish_reason == "length" and x.index == 0
    tokens = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert x.logprobs.tokens == tokens and "".join(tokens) == x.text
    assert x.logprobs.text_offset == [len("".join(tokens[:k])) for k in range(len(tokens))]
    assert x.logprobs.token_logprobs == [float(lp.logprob) for lp in sm.logprobs]
    assert x.logprobs.top_logprobs == [{tok.decode([int(i)], skip_special_tokens=False): float(v)
                                        for i, v in zip(lp.top_ids[:2], lp.top_logprobs[:2])} for lp in sm.logprobs]


# --- end to end -------------------------------------------------------------------------------------

def run_main(ck, inp, out, *overrides, check=True, popen=False):
    args = [sys.executable, "-m", "runner.main", f"--config=configs/cpu.py:{ck}", f"--config.io.input={inp}",
            f"--config.io.output={out}", "--config.mesh.data=1", "--config.mesh.num_cpu_devices=1",
            f"--config.compilation_cache.dir={os.path.dirname(ck)}/xla", *overrides]
    if popen:
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("XLA_FLAGS", None)
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return podrun(*args[2:], check=check)


def test_vllm_example_file_runs_unchanged(bpe_folder, tmp_path):
    """vLLM's examples/offline_inference/openai_batch/openai_example_batch.jsonl on a tiny random
    Llama with a BPE tokenizer and chat template: every line answered as a chat.completion the
    openai package reads, its prompt transformers' apply_chat_template, its greedy answer opening
    as transformers' generate does (checked over its first tokens: transformers' generate takes
    20 ms a token here)."""
    import torch
    import transformers

    torch.manual_seed(6)
    cfg = transformers.LlamaConfig(vocab_size=400, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 5])
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for w in m.parameters():
            w.normal_(0, 0.3)
    hf = tmp_path / "hf"
    m.save_pretrained(hf)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (hf / name).write_bytes(open(os.path.join(bpe_folder, name), "rb").read())
    podrun("runner.tools.convert", f"--source={hf}", f"--output={tmp_path / 'ck'}")
    out = tmp_path / "results.jsonl"
    example = os.path.join(DATA, "openai_example_batch.jsonl")
    run_main(tmp_path / "ck", example, out, "--config.generation.max_new_tokens=1000",
             "--config.generation.max_prompt_len=64", "--config.generation.batch_size=2")
    requests, results = read_jsonl(example), read_jsonl(out)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(bpe_folder)
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    for req, res in zip(requests, results):
        c = ChatCompletion.model_validate(check_envelope(res, req["custom_id"]))
        assert c.model == "ck" and c.object == "chat.completion" and len(c.choices) == 1
        prompt = tokenizer.apply_chat_template(req["body"]["messages"], add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
        assert c.usage.prompt_tokens == len(prompt)
        with torch.no_grad():
            ids = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=48, do_sample=False, eos_token_id=[2, 5], pad_token_id=0)[0, len(prompt):]
        ids = ids.tolist()
        text, n = c.choices[0].message.content, c.usage.completion_tokens
        assert c.choices[0].finish_reason == ("length" if n == 1000 else "stop") and n <= 1000
        if ids[-1] in (2, 5):  # transformers ended within its 48 tokens: the whole answer
            assert n == len(ids) and text == tokenizer.decode(ids, skip_special_tokens=True)
        else:  # a prefix, less a character its last tokens may have cut in two
            opening = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
            assert len(opening) > 20 and text.startswith(opening)


@pytest.mark.slow
def test_vllm_example_file_runs_unchanged_on_gptoss(enc, tmp_path):
    """The same file on a tiny random GPT-OSS (the o200k_harmony vocabulary): its prompts are
    openai-harmony's renderings, its answers chat.completions with the Harmony channels."""
    from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent

    podrun("runner.tools.convert", "--random=gptoss:tiny-o200k", f"--output={tmp_path / 'ck'}")
    out = tmp_path / "results.jsonl"
    example = os.path.join(DATA, "openai_example_batch.jsonl")
    run_main(tmp_path / "ck", example, out, "--config.generation.max_new_tokens=1000",
             "--config.generation.max_prompt_len=128", "--config.generation.batch_size=2")
    requests, results = read_jsonl(example), read_jsonl(out)
    assert [r["custom_id"] for r in results] == ["request-1", "request-2"]
    for req, res in zip(requests, results):
        c = ChatCompletion.model_validate(check_envelope(res, req["custom_id"]))
        assert c.model == "ck" and len(c.choices) == 1
        system, user = req["body"]["messages"]
        want = enc.render_conversation_for_completion(Conversation.from_messages([
            Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(system["content"])),
            Message.from_role_and_content(Role.USER, user["content"])]), Role.ASSISTANT)
        assert c.usage.prompt_tokens == len(want)
        # random weights never close a Harmony answer: all 1000 tokens, and the raw text flagged
        assert c.usage.completion_tokens == 1000 and c.choices[0].finish_reason == "length"
        assert c.choices[0].message.model_extra["chat_format_error"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    m = tiny_hf("llama", seed=4)
    root = tmp_path_factory.mktemp("llama")
    m.save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    return m, root / "ck"


def test_a_batch_file_through_runner_main_matches_transformers(llama, tmp_path):
    """Completions of token-id prompts (a checkpoint with no tokenizer: tokens are named by id)
    greedy as transformers decodes them, with its log-probabilities; bad lines get error lines
    in their places, naming their fields, and the rest is answered."""
    m, ck = llama
    rng = np.random.RandomState(3)
    prompts = [[int(t) for t in rng.randint(0, VOCAB, n)] for n in (5, 11, 2)]
    good = [{"custom_id": f"p{i}", "method": "POST", "url": TEXT_URL,
             "body": {"model": "anything", "prompt": p, "max_tokens": 6, "logprobs": 2, "user": "me"}}
            for i, p in enumerate(prompts)]
    bad = [json.loads(line) for line, _, _ in BAD if line[0] == "{" and "custom_id" in line]
    bad = [dict(b, custom_id=f"bad{i}") if isinstance(b.get("custom_id"), str) else b for i, b in enumerate(bad)]
    lines = [good[0], *bad[:8], good[1], "{not json", *bad[8:], good[2]]
    out = tmp_path / "out.jsonl"
    run_main(ck, write_jsonl(tmp_path / "in.jsonl", lines), out, "--config.generation.max_new_tokens=16",
             "--config.generation.max_prompt_len=32", "--config.generation.batch_size=2")
    results = read_jsonl(out)
    assert len(results) == len(lines)
    for line, res in zip(lines, results):
        body = check_envelope(res, line.get("custom_id") if isinstance(line, dict) and isinstance(
            line.get("custom_id"), str) else None)
        if line in good:
            c = Completion.model_validate(body)
            prompt = line["body"]["prompt"]
            ids = [int(t.removeprefix("token_id:")) for t in c.choices[0].logprobs.tokens]
            assert ids == hf_greedy(m, prompt, 6) and c.usage.prompt_tokens == len(prompt)
            logp = log_softmax(hf_logits(m, [prompt + ids])[0].astype(np.float64), axis=-1)
            np.testing.assert_allclose(c.choices[0].logprobs.token_logprobs,
                                       [logp[len(prompt) - 1 + j, t] for j, t in enumerate(ids)], atol=1e-4)
            assert c.choices[0].text == "" and c.model == "ck"
        else:
            assert body is None
    assert results[len(bad[:8]) + 2]["error"]["message"].startswith(f"line {len(bad[:8]) + 3} is not valid JSON")


def test_a_killed_batch_run_resumes_and_answers_every_custom_id_once(llama, tmp_path):
    """SIGKILL once a third of the results are in the partial file, then rerun: the results file
    is the uninterrupted run's, ids included (only `created` may differ)."""
    _, ck = llama
    rows = [{"custom_id": f"req-{i:04d}", "method": "POST", "url": TEXT_URL if i % 3 else CHAT_URL,
             "body": {"prompt": [i % 90 + 1, 5], "max_tokens": 12} if i % 3 else {"messages": "no tokenizer"}}
            for i in range(240)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    args = ("--config.generation.max_new_tokens=12", "--config.generation.max_prompt_len=8",
            "--config.generation.batch_size=2")
    out = tmp_path / "out.jsonl"
    p = run_main(ck, inp, out, *args, popen=True)
    partial = tmp_path / "out.jsonl.partial"
    while p.poll() is None:
        if partial.exists() and partial.read_text().count("\n") > len(rows) // 3:
            p.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    assert p.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not out.exists()
    run_main(ck, inp, out, *args)
    run_main(ck, inp, tmp_path / "whole.jsonl", *args)
    resumed, whole = read_jsonl(out), read_jsonl(tmp_path / "whole.jsonl")
    assert [r["custom_id"] for r in resumed] == [r["custom_id"] for r in rows]
    for r in (*resumed, *whole):
        if r["response"]["body"]:
            r["response"]["body"]["created"] = 0
    assert resumed == whole
    assert sum(r["error"] is not None for r in resumed) == 80


def test_repeated_custom_ids_stop_the_job_before_the_checkpoint_is_read(tmp_path):
    rows = [{"custom_id": c, "method": "POST", "url": TEXT_URL, "body": {"prompt": [1]}} for c in "abcab"]
    p = run_main(tmp_path / "nonexistent", write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl",
                 check=False)
    assert p.returncode != 0 and not (tmp_path / "out.jsonl").exists()
    assert p.stderr.strip().splitlines()[-1] == (
        'podrun: error: io.input: 2 custom_id(s) given more than once, but each Batch request needs its own: '
        '"a" on lines 1, 4; "b" on lines 2, 5')


# --- end to end: tools in Batch chats ---------------------------------------------------------------

TOOL_CHATS = {**test_tools.CONVERSATIONS, "several_calls": test_tools.SEVERAL_CALLS}
VLLM_TOOLS = os.path.join(DATA, "vllm_run_batch_tool_calling.jsonl")


def tool_lines(max_tokens: int) -> list[dict]:
    """Batch chats with tools, assistant tool_calls and tool results (tests/test_tools.py's), then
    a question with tool_choice naming a function (`now`), required and none."""
    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL,
                "body": {"model": "any", "max_tokens": max_tokens, "temperature": 0, **body}}

    q = test_tools.CONVERSATIONS["question"]
    return [*(line(name, messages=m, tools=test_tools.TOOLS) for name, m in TOOL_CHATS.items()),
            line("named", messages=q, tools=test_tools.TOOLS,
                 tool_choice={"type": "function", "function": {"name": "now"}}),
            line("required", messages=q, tools=test_tools.TOOLS, tool_choice="required"),
            line("none", messages=q, tools=test_tools.TOOLS, tool_choice="none")]


def chat_completions(results: list[dict], requests: list[dict]) -> list[ChatCompletion]:
    """Each line's envelope checked, its body read as the openai package's ChatCompletion."""
    assert [r["custom_id"] for r in results] == [r["custom_id"] for r in requests]
    out = []
    for req, res in zip(requests, results):
        c = ChatCompletion.model_validate(check_envelope(res, req["custom_id"]))
        assert c.object == "chat.completion" and c.model == "ck" and len(c.choices) == 1
        assert c.usage.prompt_tokens == len(res["response"]["body"]["prompt_token_ids"])
        out.append(c)
    return out


def bigram_writer(m, chain: list[int]):
    """Makes transformers model m write `chain` on from its first token: every layer adds nothing
    (its attention and MLP outputs are zero), so each next token is lm_head(norm(embedding of this
    token)); the chain's tokens get orthogonal embeddings and lm_head maps each to the one after it.
    Any other token's embedding stays random, so one of the chain's follows it."""
    import torch

    assert len(set(chain)) == len(chain), chain
    with torch.no_grad():
        for layer in m.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            zero = [attn.o_proj.weight, attn.o_proj.bias, getattr(mlp, "down_proj", None)]
            zero += [mlp.experts.down_proj, mlp.experts.down_proj_bias] if hasattr(mlp, "experts") else []
            for w in zero:
                if isinstance(w, torch.nn.Module):
                    w = w.weight
                if w is not None:
                    w.zero_()
        m.model.norm.weight.fill_(1)
        embed, head = m.model.embed_tokens.weight, m.lm_head.weight
        head.mul_(0.01)
        for k, (t, nxt) in enumerate(zip(chain, chain[1:])):
            embed[t] = 0
            embed[t, k] = 1
            head[nxt] = 0
            head[nxt, k] = 10
    return m


@pytest.mark.slow  # tests/test_tools.py checks the same rendering and parsing against openai-harmony
def test_tool_chats_on_gptoss_render_as_openai_harmony(enc, tmp_path):
    """A Batch file of chats with tools, calls and results on a tiny GPT-OSS: the prompt each
    request used (io.echo_prompt) is openai-harmony's rendering with the function tools, then for a
    named function or `required` the header that starts the call; every line a ChatCompletion. Its
    weights (bigram_writer) answer the named `now` with `{}` and <|call|>, as transformers' generate
    confirms: the job reads that call as openai-harmony's parser reads the whole message."""
    import torch
    from openai_harmony import Role

    from runner.text import o200k
    from tests.reference import tiny_hf

    message, call = enc.encode("<|message|>", allowed_special="all"), enc.encode("<|call|>", allowed_special="all")
    m = bigram_writer(tiny_hf("gptoss", vocab_size=o200k.VOCAB_SIZE, num_hidden_layers=1),
                      [*message, *enc.encode("{}"), *call])
    m.save_pretrained(tmp_path / "hf")
    o200k.write_tokenizer_files(str(tmp_path / "hf"))
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    requests = tool_lines(max_tokens=2)
    out = tmp_path / "out.jsonl"
    run_main(tmp_path / "ck", write_jsonl(tmp_path / "in.jsonl", requests), out, "--config.io.echo_prompt=true",
             "--config.generation.max_new_tokens=2", "--config.generation.max_prompt_len=512",
             "--config.generation.batch_size=8")
    results = read_jsonl(out)
    for req, res, c in zip(requests, results, chat_completions(results, requests)):
        body, name = req["body"], req["custom_id"]
        tools = None if body.get("tool_choice") == "none" else body["tools"]
        prompt = test_tools.harmony_reference(enc, body["messages"], tools)
        head = {"named": test_tools.HARMONY_FORCED["get_weather"].replace("get_weather", "now"),
                "required": test_tools.HARMONY_FORCED["required"]}.get(name)
        head = enc.encode(head, allowed_special="all") if head else []
        assert res["response"]["body"]["prompt_token_ids"] == [*prompt, *head], name
        x = c.choices[0]
        if name == "named":
            with torch.no_grad():
                ids = m.generate(torch.tensor([[*prompt, *head]]), max_new_tokens=2, do_sample=False,
                                 eos_token_id=call, pad_token_id=0)[0, len(prompt) + len(head):].tolist()
            assert ids == [*enc.encode("{}"), *call] and c.usage.completion_tokens == 2
            want = test_tools.harmony_calls(enc.parse_messages_from_completion_tokens([*head, *ids], Role.ASSISTANT))
            [tc] = x.message.tool_calls
            assert [(tc.function.name, tc.function.arguments)] == want == [("now", "{}")]
            assert x.finish_reason == "tool_calls" and not x.message.content
        else:  # no call ended in two tokens
            assert x.message.tool_calls is None and x.finish_reason in ("length", "stop"), name


@pytest.fixture(scope="module")
def qwen_writer(tmp_path_factory):
    """A tiny Llama with the Qwen2.5 chat template's tokenizer that writes (bigram_writer), after
    the prompt a named `now` ends with, the rest of that call as the template writes it, then
    <|im_end|>."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("qwen_writer")
    # the BPE has seen tool calls, so that `}}` is one token (as in Qwen's own vocabulary)
    calls = [json.dumps({"name": "now", "arguments": {}}), json.dumps({"name": "f", "arguments": {"a": 1}})]
    folder = test_tools.template_tokenizer(root / "tok", "qwen2.5", [c for c in calls for _ in range(20)])
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    q = test_tools.CONVERSATIONS["question"]
    prompt = hf.apply_chat_template(q, tools=test_tools.TOOLS, add_generation_prompt=True, tokenize=False)
    reply = hf.apply_chat_template([*q, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "now", "arguments": {}}}]}], tools=test_tools.TOOLS, tokenize=False)
    head = '<tool_call>\n{"name": "now", "arguments":'
    call = reply[len(prompt):]
    assert call.startswith(head) and call.endswith("<|im_end|>\n")
    chain = [hf.encode(head, add_special_tokens=False)[-1],
             *hf.encode(call[len(head):-len("\n")], add_special_tokens=False)]
    assert chain[-1] == hf.convert_tokens_to_ids("<|im_end|>"), chain

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(hf), hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                                   tie_word_embeddings=False, eos_token_id=chain[-1])
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for w in m.parameters():
            w.normal_(0, 0.3)
    bigram_writer(m, chain)
    m.save_pretrained(root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / "hf" / name).write_bytes(open(os.path.join(folder, name), "rb").read())
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    return m, hf, root / "ck", call


def test_tool_chats_on_a_chat_template_match_transformers(qwen_writer, tmp_path):
    """The same chats, and vLLM's tool-calling Batch line, on a checkpoint with the Qwen2.5 chat
    template: each prompt is transformers' apply_chat_template(tools=...) (then the start of the
    call for a named function or `required`), each answer transformers' greedy one; the named
    `now` is answered with that call (read from the model's own tokens), finish_reason tool_calls."""
    import torch

    m, hf, ck, call = qwen_writer
    requests = [*tool_lines(max_tokens=8), *read_jsonl(VLLM_TOOLS)]
    out = tmp_path / "out.jsonl"
    run_main(ck, write_jsonl(tmp_path / "in.jsonl", requests), out, "--config.io.echo_prompt=true",
             "--config.generation.max_new_tokens=1000", "--config.generation.max_prompt_len=2048",
             "--config.generation.batch_size=8")
    results = read_jsonl(out)
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    for req, res, c in zip(requests, results, chat_completions(results, requests)):
        body, name = req["body"], req["custom_id"]
        tools = None if body.get("tool_choice") == "none" else body["tools"]
        prompt = test_tokenizer.ids_of(hf.apply_chat_template(
            test_tools.as_template_gets_them(body["messages"]), tools=tools, add_generation_prompt=True))
        head = {"named": '<tool_call>\n{"name": "now", "arguments":', "required": '<tool_call>\n{"name": "',
                "request-1": '<tool_call>\n{"name": "'}.get(name, "")
        prompt += hf.encode(head, add_special_tokens=False)
        assert res["response"]["body"]["prompt_token_ids"] == prompt, name
        with torch.no_grad():
            ids = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=min(body["max_tokens"], 48), do_sample=False, eos_token_id=eos,
                             pad_token_id=0)[0, len(prompt):].tolist()
        x = c.choices[0]
        assert ids[-1] == eos and c.usage.completion_tokens == len(ids), (name, ids)  # ended within 48
        text = head + hf.decode(ids, skip_special_tokens=False).removesuffix("<|im_end|>")
        if name == "named":  # the model wrote the template's own call: read back as that call
            assert text + "<|im_end|>\n" == call
            assert x.finish_reason == "tool_calls" and not x.message.content
            [tc] = x.message.tool_calls
            assert (tc.function.name, json.loads(tc.function.arguments)) == ("now", {})
        else:  # no call, or one the template's syntax cannot read: text, the call's start included
            assert x.message.tool_calls is None and x.finish_reason == "stop", (name, text)
            assert x.message.content == head + hf.decode(ids, skip_special_tokens=True)
