"""OpenAI Batch files, as `vllm run-batch` and OpenAI's Batch API read and write them: a request
line read into a request (`parse_line`), its result written from its answer (`result_line`) or
from its error (`error_line`).

A request line: {"custom_id": str, "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}; its body becomes podrun's request fields (`request_fields`),
which common.parse_fields then checks. A result line, written from the request's answer
(common.Answer): {"id": "batch_req_...", "custom_id", "response": {"status_code": 200,
"request_id": "req_...", "body": <chat.completion | text_completion>}, "error": null}, or for a
request that cannot be served {..., "response": {"status_code": 400, "request_id", "body": null},
"error": {"object": "error", "message", "type": "BadRequestError", "param", "code", "line"}}:
vLLM's ErrorResponse, with OpenAI's BatchError's string `code` (invalid_request, invalid_json,
unknown_parameter, context_length_exceeded) and input `line`.

custom_ids are unique in a file (`check_ids`), so a rerun resumes a Batch file's results exactly
as podrun's own (the results file is keyed by line index and the input's hash, and the index
stands for the custom_id). Ids are hashes of the custom_id, so a rerun gives the same.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
from typing import Any

from runner.api.common import (Answer, Choice, Line, Parsed, Token, failed, is_ids,
                               parse_fields, refuse_repeated)
from runner.errors import RequestError, quote
from runner.settings import Settings

KEYS = ("custom_id", "method", "url", "body")  # a Batch line's: any of them marks a line as one
ID_KEY = "custom_id"  # the result line's field that names its request
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
OBJECTS = {CHAT_URL: "chat.completion", COMPLETIONS_URL: "text_completion"}

# Body fields passed on to podrun's request under their own name, for podrun's parser to check
# (tools and response_format included: whatever it serves, a Batch body carries).
_SAMPLING = ("temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs", "response_format",
             "guided_json", "guided_regex", "guided_choice")
PASSED = {CHAT_URL: ("messages", *_SAMPLING, "top_logprobs", "reasoning_effort", "tools", "tool_choice"),
          COMPLETIONS_URL: ("prompt", *_SAMPLING)}
MAX_TOKENS = {CHAT_URL: ("max_completion_tokens", "max_tokens"), COMPLETIONS_URL: ("max_tokens",)}
# OpenAI fields that change nothing here: the deployment is the model, results are not stored.
IGNORED = ("model", "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "stream_options")
# OpenAI fields served at their default only (null is the default too).
_DEFAULTS = {"stream": False, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}}
DEFAULT_ONLY = {CHAT_URL: {**_DEFAULTS, "parallel_tool_calls": True},
                COMPLETIONS_URL: {**_DEFAULTS, "echo": False, "best_of": 1, "suffix": ""}}
MIN_LOGPROB = -9999.0  # OpenAI's stand-in for a token too unlikely to have a finite log-probability


def line_id(line: Line) -> str | None:
    """The custom_id the result of `line` carries (None for a line without a string one)."""
    d, _ = line.decoded
    return d.get("custom_id") if d is not None and isinstance(d.get("custom_id"), str) else None


def check_ids(lines: list[Line]) -> None:
    """Refuses a file (RequestFileError) in which two lines give the same custom_id."""
    refuse_repeated(((line_id(line), str(line.number)) for line in lines), ID_KEY, "Batch request")


def parse_line(index: int, line: Line, tokenizer, s: Settings, vocab_size: int, chat=None,
               grammars=None) -> Parsed:
    """One Batch line -> a request (its body renamed into podrun's fields, which
    common.parse_fields checks), or one carrying the reason it cannot be served. Never raises."""
    d, error = line.decoded
    if d is None:
        return Parsed(index, None, error=error, code="invalid_json", line=line.number)
    custom_id = d.get("custom_id")
    try:
        url, fields, renamed = request_fields(d)
    except Exception as e:  # whatever the line holds, its own error result and not the run's end
        return failed(index, custom_id if isinstance(custom_id, str) else None, line.number, e)
    p = parse_fields(index, line.number, fields, custom_id, tokenizer, s, vocab_size, chat, grammars,
                     names=renamed)
    p.api = OBJECTS[url]
    return p


def request_fields(d: dict) -> tuple[str, dict, dict[str, str]]:
    """A Batch line -> (its url, the podrun request its body makes, {podrun's name: the body's}
    for fields it renames); a ValueError naming the field where the line is not a Batch request
    podrun serves."""
    if "custom_id" not in d:
        raise RequestError("custom_id is missing: a Batch line has custom_id, method, url and body", "custom_id")
    if not isinstance(d["custom_id"], str):
        raise RequestError(f"custom_id={quote(d['custom_id'])} is not a string", "custom_id")
    for key in d:
        if key not in KEYS:
            raise RequestError(f"unknown field {quote(key)}: a Batch line has custom_id, method, url and body",
                               key, "unknown_parameter")
    if d.get("method") != "POST":
        raise RequestError(f"method={quote(d.get('method'))}: Batch requests are POST", "method")
    url = d.get("url")
    if not isinstance(url, str) or url not in OBJECTS:
        raise RequestError(f"url={quote(url)} is not served: use {CHAT_URL} or {COMPLETIONS_URL}", "url")
    body = d.get("body")
    if not isinstance(body, dict):
        raise RequestError(f"body={quote(body)} is not a JSON object", "body")
    fields: dict[str, Any] = {}
    renamed: dict[str, str] = {}
    defaults = DEFAULT_ONLY[url]
    for key, value in body.items():
        if key in PASSED[url]:
            fields[key] = value
        elif key in defaults:
            if not _is_default(value, defaults[key]):
                if key == "stream":
                    raise RequestError(f"stream={quote(value)}: a Batch request is answered whole; "
                                       "leave stream out or false", "stream")
                raise RequestError(f"{key}={quote(value)} is not supported: podrun serves only "
                                   f"{key}={quote(defaults[key])}", key)
        elif key not in IGNORED and key not in MAX_TOKENS[url]:
            raise RequestError(_unknown_body_field(key, url), key, "unknown_parameter")
    given = [k for k in MAX_TOKENS[url] if body.get(k) is not None]
    if len(given) == 2 and body[given[0]] != body[given[1]]:
        raise RequestError(f"max_completion_tokens={quote(body[given[0]])} and max_tokens="
                           f"{quote(body[given[1]])} differ: give one of them", "max_completion_tokens")
    if given:
        fields["max_tokens"] = body[given[0]]
        renamed["max_tokens"] = given[0]
    if url == CHAT_URL:
        if "messages" not in body:
            raise RequestError(f"messages is missing: {CHAT_URL} answers a list of messages", "messages")
        if not isinstance(body.get("logprobs"), bool | None):
            raise RequestError(f"logprobs={quote(body['logprobs'])}: a boolean in chat completions "
                               "(top_logprobs gives the count)", "logprobs")
        if isinstance(body["messages"], list):
            fields["messages"] = [_text_parts_joined(m) for m in body["messages"]]
    else:
        if "prompt" not in body:
            raise RequestError(f"prompt is missing: {COMPLETIONS_URL} answers a prompt", "prompt")
        if isinstance(body.get("logprobs"), bool):
            raise RequestError(f"logprobs={quote(body['logprobs'])}: a count of alternatives per "
                               "token in completions", "logprobs")
        key, fields["prompt"] = _one_prompt(fields.pop("prompt"))
        if key != "prompt":
            fields[key] = fields.pop("prompt")
            renamed[key] = "prompt"
    return url, fields, renamed


def _is_default(value: Any, default: Any) -> bool:
    """value is null or the default itself (not a 0 standing for false, nor true for 1)."""
    return value is None or (isinstance(value, bool) == isinstance(default, bool) and value == default)


def _unknown_body_field(key: str, url: str) -> str:
    other = COMPLETIONS_URL if url == CHAT_URL else CHAT_URL
    if key in PASSED[other] or key in MAX_TOKENS[other] or key in DEFAULT_ONLY[other]:
        return f"body field {quote(key)} belongs to {other}, not {url}"
    known = [*PASSED[url], *MAX_TOKENS[url], *DEFAULT_ONLY[url], *IGNORED]
    near = difflib.get_close_matches(key, known, n=1)
    return f"unknown body field {quote(key)} for {url}" + (f": did you mean {near[0]!r}?" if near else "")


def _text_parts_joined(message: Any) -> Any:
    """A message whose content is a list of text parts, with them joined by newlines (as vLLM
    renders them); any other message as it is, for podrun's parser to judge."""
    if not isinstance(message, dict):
        return message
    parts = message.get("content")
    if isinstance(parts, list) and parts and all(
            isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in parts):
        return {**message, "content": "\n".join(x["text"] for x in parts)}
    return message


def _one_prompt(prompt: Any) -> tuple[str, Any]:
    """A completions prompt (a string, token ids, or a list holding one of either) -> podrun's
    field and value."""
    if isinstance(prompt, list) and len(prompt) == 1 and (
            isinstance(prompt[0], str) or is_ids(prompt[0])):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return "prompt", prompt
    if is_ids(prompt):
        return "prompt_token_ids", prompt
    if isinstance(prompt, list) and all(isinstance(x, str) or is_ids(x) for x in prompt):
        raise RequestError(f"prompt holds {len(prompt)} prompts: give one per Batch request", "prompt")
    raise RequestError(f"prompt={quote(prompt)}: give a string or a list of token ids", "prompt")


# --- results ----------------------------------------------------------------------------------------

def _key(p: Parsed) -> str:
    """Ids derived from the custom_id (a line without a readable one: its place in the file)."""
    name = p.id if isinstance(p.id, str) else f"#{p.index}"
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def error_line(p: Parsed) -> dict:
    """The Batch result line of request p, which cannot be served (p.error)."""
    key = _key(p)
    return {"id": f"batch_req_{key}", "custom_id": p.id,
            "response": {"status_code": 400, "request_id": f"req_{key}", "body": None},
            "error": {"object": "error", "message": p.error, "type": "BadRequestError",
                      "param": p.param, "code": p.code or "invalid_request", "line": p.line or None}}


def result_line(p: Parsed, a: Answer, model: str, created: int) -> dict:
    """The Batch result line of request p from its answer a: a chat.completion or a
    text_completion, as p's url asked."""
    key = _key(p)
    chat = p.api == OBJECTS[CHAT_URL]
    usage = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
             "total_tokens": a.prompt_tokens + a.completion_tokens}
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{key}", "object": p.api, "created": created,
            "model": model, "choices": [(_chat_choice if chat else _text_choice)(k, c)
                                        for k, c in enumerate(a.choices)],
            "usage": usage}
    if a.prompt_token_ids is not None:  # io.echo_prompt, where vLLM puts it
        body["prompt_token_ids"] = list(a.prompt_token_ids)
    return {"id": f"batch_req_{key}", "custom_id": p.id,
            "response": {"status_code": 200, "request_id": f"req_{key}", "body": body}, "error": None}


def _chat_choice(index: int, c: Choice) -> dict:
    calls = list(c.tool_calls)
    message = {"role": "assistant", "content": c.text if c.text or not calls else None}
    if c.reasoning:
        message["reasoning_content"] = c.reasoning
    if calls:
        message["tool_calls"] = calls
    # Harmony's commentary and a broken format: fields OpenAI's message does not have
    if c.commentary is not None:
        message["commentary"] = c.commentary
    if c.chat_format_error is not None:
        message["chat_format_error"], message["raw"] = c.chat_format_error, c.raw
    logprobs = None
    if c.logprobs is not None:
        logprobs = {"content": [dict(_token(x), top_logprobs=[_token(t) for t in x.top])
                                for x in c.logprobs]}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": c.finish_reason}


def _token(x: Token) -> dict:
    """{token, logprob, bytes} in OpenAI's shape; a token with no text (no tokenizer) is named
    `token_id:<id>`, as vLLM names it."""
    return {"token": f"token_id:{x.id}" if x.text is None else x.text,
            "logprob": max(x.logprob, MIN_LOGPROB),
            "bytes": None if x.text is None else list(x.text.encode("utf-8", "replace"))}


def _text_choice(index: int, c: Choice) -> dict:
    logprobs = None
    if c.logprobs is not None:  # the completions API's columns: offsets into the text, alternatives by text
        entries = [_token(x) for x in c.logprobs]
        offsets = itertools.accumulate((len(e["token"]) for e in entries), initial=0)
        logprobs = {"tokens": [e["token"] for e in entries],
                    "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in map(_token, x.top)}
                                     for x in c.logprobs],
                    "text_offset": list(offsets)[:-1]}
    return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
