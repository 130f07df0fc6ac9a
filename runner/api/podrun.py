"""podrun's own request and result lines: a line read into a request (`parse_line`), its result
written from its answer (`result_line`) or from its error (`error_line`).

A request line: {"id": ..., "prompt": "..."} | {"id": ..., "messages": [{"role", "content"}]} |
{"id": ..., "prompt_token_ids": [...]}, with the optional fields of common.py (FIELDS lists them
all). A line without an id (or one that is not a JSON object) is answered under its line number;
the ids a file's results carry, given or taken so, are unique (`check_ids`: a repeat refuses the
file, since results are matched to requests by id).

A result line: {"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}} (+ "logprobs", "prompt_logprobs", "continuation", "prompt_token_ids" when
asked, "tool_calls" when the model called a tool; "reasoning", "commentary" from Harmony), with
n > 1 {"id", "choices": [{"index", "text", ...}], "usage"}; a request that cannot be served
{"id", "error"}.
"""

from __future__ import annotations

import difflib
from typing import Any

from runner.api.common import (Answer, Choice, Line, Parsed, Token, failed, parse_fields,
                               refuse_repeated)
from runner.api.openai_batch import KEYS as BATCH_KEYS
from runner.errors import RequestError
from runner.settings import Settings
from runner.text import structured
from runner.text.chat import ChatFormat

ID_KEY = "id"  # the result line's field that names its request
FIELDS = ("id", "prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p",
          "top_k", "stop", "seed", "reasoning_effort", "n", "logprobs", "top_logprobs",
          "prompt_logprobs", "continuation", "tools", "tool_choice", *structured.FIELDS)


def line_id(line: Line) -> Any:
    """The id the result of `line` carries: the one it gives, else its line number."""
    d, _ = line.decoded
    return line.number if d is None else d.get("id", line.number)


def check_ids(lines: list[Line]) -> None:
    """Refuses a file (RequestFileError) in which two lines' results would carry one id (compared
    as JSON values: "7" is not 7): one given twice, or given where a line without one takes its
    line number. A null id is left as given."""
    def named(line: Line) -> str:
        d, _ = line.decoded
        given = d is not None and "id" in d
        return str(line.number) if given else f"{line.number} (no id: its line number)"

    refuse_repeated(((line_id(line), named(line)) for line in lines), ID_KEY, "request")


def check_known(d: dict) -> None:
    """A RequestError for the first field that is not a request field."""
    for key in d:
        if key in FIELDS:
            continue
        if key in BATCH_KEYS:
            raise RequestError(f"field {key!r} belongs to OpenAI Batch lines ({', '.join(BATCH_KEYS)}), and "
                               "this line is in podrun's format: give one format per file", key,
                               "unknown_parameter")
        near = difflib.get_close_matches(key, FIELDS, n=1)
        name = key if len(key) <= 40 else key[:37] + "..."
        raise RequestError(f"unknown field {name!r}: " + (f"did you mean {near[0]!r}?" if near else
                                                            f"request fields are {', '.join(FIELDS)}"),
                           key, "unknown_parameter")


def parse_line(index: int, line: Line, tokenizer, s: Settings, vocab_size: int,
               chat: ChatFormat | None = None, grammars: structured.Grammars | None = None) -> Parsed:
    """One line -> a request ready to generate, or one carrying the reason it cannot be served.
    Never raises: whatever the line holds, it gets its own result.

    `chat` renders chat requests (default: the tokenizer's own chat template); `grammars`
    compiles the request's format, if it has one."""
    d, error = line.decoded
    if d is None:
        return Parsed(index, line.number, error=error, code="invalid_json", line=line.number)
    rid = d.get("id", line.number)
    try:
        check_known(d)
    except RequestError as e:
        return failed(index, rid, line.number, e)
    return parse_fields(index, line.number, d, rid, tokenizer, s, vocab_size, chat, grammars)


# --- results ----------------------------------------------------------------------------------------

def error_line(p: Parsed) -> dict:
    """The result line of request p, which cannot be served (p.error)."""
    return {"id": p.id, "error": p.error}


def result_line(a: Answer) -> dict:
    """The result line of answer a: one sample's fields at the top, several as `choices`."""
    choices = [_choice(c) for c in a.choices]
    r = {"id": a.id, **choices[0]} if len(choices) == 1 else {
        "id": a.id, "choices": [{"index": k, **c} for k, c in enumerate(choices)]}
    r["usage"] = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens}
    if a.prompt_logprobs is not None:
        r["prompt_logprobs"] = [None] + [_token(t) for t in a.prompt_logprobs]
    if a.continuation is not None:
        x = a.continuation
        r["continuation"] = {"logprob": x.logprob, "is_greedy": x.is_greedy, "token_ids": list(x.token_ids)}
    if a.prompt_token_ids is not None:
        r["prompt_token_ids"] = list(a.prompt_token_ids)
    return r


def _choice(c: Choice) -> dict:
    r = {"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
    if c.incomplete_format:
        r["incomplete_format"] = True
    if c.reasoning is not None:
        r["reasoning"] = c.reasoning
    if c.commentary is not None:
        r["commentary"] = c.commentary
    if c.chat_format_error is not None:
        r["chat_format_error"], r["raw"] = c.chat_format_error, c.raw
    if c.tool_calls:
        r["tool_calls"] = list(c.tool_calls)
    if c.logprobs is not None:
        r["logprobs"] = {"content": [_token(t) for t in c.logprobs]}
    return r


def _token(t: Token) -> dict:
    """As OpenAI's chat completions give a token's log-probabilities, with the ids."""
    return {"id": t.id, "token": t.text, "logprob": t.logprob,
            "top_logprobs": [{"id": a.id, "token": a.text, "logprob": a.logprob} for a in t.top]}
