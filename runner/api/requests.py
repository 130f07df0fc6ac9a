"""Requests in: podrun's request lines read into requests the engine runs, or the error each one
gets.

A request line: {"id": ..., "prompt": "..."} | {"id": ..., "messages": [{"role", "content"}]} |
{"id": ..., "prompt_token_ids": [...]}, with optional max_tokens, temperature, top_p, top_k, stop,
seed, n, logprobs (top_logprobs), prompt_logprobs, continuation, for chats tools and tool_choice
(runner/text/tools.py), and a format (response_format, guided_json, guided_regex, guided_choice:
runner/text/structured.py). OpenAI Batch lines (batch.py) become such requests. Each line is
decoded once; a line that cannot be served becomes an error value (errors.RequestError) naming
its field, never an exception that ends the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from typing import Any

from etils import epath

from runner.api.errors import RequestError, RequestFileError, quote
from runner.api.results import check_bucket
from runner.engine import Request
from runner.engine.engine import MAX_LOGPROBS  # alternatives per token the programs compute
from runner.settings import Settings
from runner.text import structured
from runner.text import tools as chat_tools
from runner.text.chat import ChatFormat, TemplateChat


@dataclasses.dataclass(eq=False)
class Line:
    """A non-blank line of the request file; `decoded` its JSON object, read once."""

    number: int  # 1-based, blank lines counted, as an editor shows it: messages and default ids
    text: str  # UTF-8; bytes that are not UTF-8 kept as lone surrogates (surrogateescape)

    @functools.cached_property
    def decoded(self) -> tuple[dict | None, str]:
        """The line's JSON object, or None and the one-line reason it is not one."""
        return _decode(self)

    def release(self) -> None:
        """Drops the decoded object once the line is parsed (a file's objects take far more
        memory than its text)."""
        self.__dict__.pop("decoded", None)


@dataclasses.dataclass
class Parsed:
    index: int  # 0-based among the file's non-blank lines: the output order
    id: Any
    prompt_ids: tuple[int, ...] = ()
    error: str = ""
    max_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0
    chat: bool = False  # given as messages (its completion may be parsed by the chat format)
    n: int = 1
    logprobs: int | None = None  # alternatives per generated token (None: no log-probabilities)
    prompt_logprobs: int | None = None  # alternatives per prompt token
    continuation: int = 0  # the prompt's last tokens that are a continuation to score
    tools: bool = False  # the prompt offers tools: tool calls are read out of the completion
    # The start of a call the prompt ends with (tool_choice required or a function): read before
    # the completion when its calls are read.
    call_prefix: tuple[int, ...] = ()
    api: str = ""  # an OpenAI Batch line's object (chat.completion, text_completion); "": podrun's
    constraint: Any = None  # the compiled format the completion follows (structured.Grammar)
    code: str = ""  # with an error: its kind (RequestError.code)
    param: str | None = None  # with an error: the field it is about (RequestError.field)
    line: int = 0  # the line of the request file it was read from

    def request(self) -> Request:
        """What the engine runs for it."""
        return Request(self.prompt_ids, self.max_tokens, self.temperature, self.top_k, self.top_p, self.seed,
                       logprobs=self.logprobs is not None,
                       prompt_logprobs=self.prompt_logprobs is not None or self.continuation > 0,
                       prompt_logprobs_from=(1 if self.prompt_logprobs is not None
                                             else len(self.prompt_ids) - self.continuation),
                       n=self.n, constraint=self.constraint)


# A request line's fields; BATCH are an OpenAI Batch line's (batch.py).
FIELDS = ("id", "prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p",
          "top_k", "stop", "seed", "reasoning_effort", "n", "logprobs", "top_logprobs",
          "prompt_logprobs", "continuation", "tools", "tool_choice", *structured.FIELDS)
BATCH = ("custom_id", "method", "url", "body")
INT32_MAX = 2**31 - 1
MAX_N = 128  # samples per request


def _number(d: dict, key: str, default: Any, kind: type, lo: float | None = None,
            hi: float | None = None, above: bool = False, name: str = "") -> Any:
    """d[key] as a `kind` in [lo, hi] (lo excluded when `above`), default when absent or null; a
    RequestError naming the field (`name`, as the line gave it; key by default), the value and
    the range."""
    name = name or key
    if key not in d or d[key] is None:
        return default
    v = d[key]
    noun = "an integer" if kind is int else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            kind is int and not (isinstance(v, int) or (math.isfinite(v) and v == int(v)))):
        raise RequestError(f"{name}={quote(v)} is not {noun}", name)
    if hi is not None:
        bounds = f"{noun} above {lo} and at most {hi}" if above else f"{noun} from {lo} to {hi}"
    else:
        bounds = f"{noun} {'above' if above else 'at least'} {lo}"
    if not (math.isfinite(v) and (lo is None or v > lo or (v == lo and not above))
            and (hi is None or v <= hi)):
        raise RequestError(f"{name}={quote(v)} is out of range: give {bounds}", name)
    return kind(v)


def _check_known(d: dict) -> None:
    """A RequestError for the first field that is not a request field."""
    for key in d:
        if key in FIELDS:
            continue
        if key in BATCH:
            raise RequestError(f"field {key!r} belongs to OpenAI Batch lines ({', '.join(BATCH)}), and "
                               "this line is in podrun's format: give one format per file", key,
                               "unknown_parameter")
        near = difflib.get_close_matches(key, FIELDS, n=1)
        name = key if len(key) <= 40 else key[:37] + "..."
        raise RequestError(f"unknown field {name!r}: " + (f"did you mean {near[0]!r}?" if near else
                                                            f"request fields are {', '.join(FIELDS)}"),
                           key, "unknown_parameter")


def decode(line: Line) -> tuple[dict | None, str]:
    """A line's JSON object, or None and the one-line reason it is not one (decoded once a line)."""
    return line.decoded


def _decode(line: Line) -> tuple[dict | None, str]:
    where = f"line {line.number}"
    try:
        line.text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = len(line.text[: e.start].encode("utf-8", "surrogateescape")) + 1
        return None, f"{where} is not UTF-8 (byte {byte} of the line)"
    try:
        d = json.loads(line.text)
    except json.JSONDecodeError as e:
        return None, f"{where} is not valid JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return None, f"{where} is JSON nested too deeply to read"
    if not isinstance(d, dict):
        return None, f"{where} is not a JSON object"
    return d, ""


def parse_request(index: int, line: Line, tokenizer, s: Settings, vocab_size: int,
                  chat: ChatFormat | None = None, grammars: structured.Grammars | None = None) -> Parsed:
    """One line -> a request ready to generate, or one carrying the reason it cannot be served.
    Never raises: whatever the line holds, it gets its own result.

    `chat` renders chat requests (default: the tokenizer's own chat template); `grammars`
    compiles the request's format, if it has one."""
    d, error = decode(line)
    if d is None:
        return Parsed(index, line.number, error=error, code="invalid_json", line=line.number)
    return parse_fields(index, line.number, d, d.get("id", line.number), tokenizer, s, vocab_size,
                        chat, grammars)


def parse_fields(index: int, number: int, d: dict, rid: Any, tokenizer, s: Settings, vocab_size: int,
                 chat: ChatFormat | None = None, grammars: structured.Grammars | None = None,
                 names: dict[str, str] | None = None) -> Parsed:
    """A request's fields (line `number`'s, answered as `rid`) -> a request or its error.
    names: {field: what the line called it} where the line's format names a field otherwise
    (an OpenAI chat's max_completion_tokens): errors name the field as the line gave it."""
    g, samp = s.generation, s.sampling
    max_tokens_name = (names or {}).get("max_tokens", "max_tokens")
    try:
        _check_known(d)
        n = _number(d, "n", 1, int, 1, MAX_N)
        logprobs, prompt_logprobs = _logprobs(d)
        scoring = prompt_logprobs is not None or d.get("continuation") is not None
        max_tokens = _number(d, "max_tokens", 0 if "continuation" in d else g.max_new_tokens, int,
                             0, name=max_tokens_name)
        if max_tokens == 0 and not scoring:
            raise RequestError(f"{max_tokens_name}=0 generates nothing: ask for prompt_logprobs or give "
                               "a continuation to score", max_tokens_name)
        if max_tokens > g.max_new_tokens:
            raise RequestError(f"{max_tokens_name}={max_tokens} exceeds generation.max_new_tokens="
                               f"{g.max_new_tokens}", max_tokens_name)
        temperature = _number(d, "temperature", samp.temperature, float, 0)
        top_p = _number(d, "top_p", samp.top_p, float, 0, 1, above=True)
        top_k = _number(d, "top_k", samp.top_k, int, 0, INT32_MAX)
        seed = _number(d, "seed", samp.seed, int)
        stop = d.get("stop")
        stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
            raise RequestError(f"stop={quote(d['stop'])}: give a non-empty string or a list of them", "stop")
        ids, offered, prefix = _prompt_ids(d, tokenizer, vocab_size, chat, (names or {}).get(
            "prompt_token_ids", "prompt_token_ids"))
        if not ids:
            raise RequestError("the prompt is empty")
        constraint = None
        if (fmt := _about(structured.FIELDS, structured.parse_format, d)) is not None:
            if offered:  # a call is the model's own syntax; a format would forbid it
                raise RequestError(f"{fmt.field}: a format and tools do not go together; give one", fmt.field)
            if grammars is None:
                raise RequestError(f"{fmt.field}: this checkpoint has no tokenizer, which a format needs",
                                   fmt.field)
            if scoring:
                raise RequestError(f"{fmt.field}: a format applies to generated text, not to scoring", fmt.field)
            constraint = _about(fmt.field, grammars.compile, fmt, chat="messages" in d)
        continuation = _continuation(d, tokenizer, vocab_size)
        ids = list(ids) + continuation
        if len(ids) > g.max_prompt_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than generation.max_prompt_len="
                               f"{g.max_prompt_len}", code="context_length_exceeded")
    except Exception as e:  # whatever the line holds, its own error result and not the run's end
        message = str(e) if isinstance(e, ValueError | TypeError) else f"{type(e).__name__}: {e}"
        message = " ".join(message.split())  # one line, whatever the library wrote
        return Parsed(index, rid, error=message if len(message) <= 400 else message[:397] + "...",
                      code=getattr(e, "code", "invalid_request"), param=getattr(e, "field", None),
                      line=number)
    # A request's random stream is its own seed's, wherever it stands in the file and whatever
    # runs beside it; without one, sampling.seed's mixed with the request's line number.
    row_seed = (seed if "seed" in d and d["seed"] is not None
                else samp.seed * 1_000_003 + number) % (2**32)
    return Parsed(index, rid, tuple(ids), "", max_tokens, temperature, top_k, top_p,
                  tuple(stop) + s.generation.stop, row_seed, chat="messages" in d, n=n,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  continuation=len(continuation), tools=offered, call_prefix=tuple(prefix),
                  constraint=constraint, line=number)


def _about(field: str | tuple[str, ...], f, *args, **kwargs):
    """f(*args, **kwargs), its ValueErrors made RequestErrors about `field` (the first of several
    given that the request holds) where they do not name their own."""
    try:
        return f(*args, **kwargs)
    except RequestError:
        raise
    except ValueError as e:
        if isinstance(field, tuple):
            field = next((k for k in field if k in args[0]), None)
        raise RequestError(str(e), field) from e


def _logprobs(d: dict) -> tuple[int | None, int | None]:
    """(alternatives per generated token, per prompt token), None where not asked. `logprobs` is
    a count (as in OpenAI's completions), or true with `top_logprobs` the count (as in its chat
    completions)."""
    given = d.get("logprobs")
    if isinstance(given, bool):
        top = _number(d, "top_logprobs", 0, int, 0, MAX_LOGPROBS)
        generated = top if given else None
        if not given and d.get("top_logprobs") is not None:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        if d.get("top_logprobs") is not None:
            raise RequestError("top_logprobs goes with logprobs: true; or give logprobs as a count", "top_logprobs")
        generated = _number(d, "logprobs", None, int, 0, MAX_LOGPROBS)
    prompt = _number(d, "prompt_logprobs", None, int, 0, MAX_LOGPROBS)
    return generated, prompt


def _continuation(d: dict, tokenizer, vocab_size: int) -> list[int]:
    """A continuation's ids (text, tokenised without special tokens, or ids), to score after the
    prompt; [] when there is none."""
    c = d.get("continuation")
    if c is None:
        return []
    if isinstance(c, str):
        if tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer; give the continuation as ids", "continuation")
        ids = tokenizer.encode(c, add_special_tokens=False) if c else []
    elif isinstance(c, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in c):
        ids = c
        outside = next((k for k, i in enumerate(ids) if not 0 <= i < vocab_size), None)
        if outside is not None:
            raise RequestError(f"continuation[{outside}]={quote(ids[outside])} is outside the "
                               f"vocabulary of {vocab_size} ids", "continuation")
    else:
        raise RequestError(f"continuation={quote(c)}: give a string or a list of token ids", "continuation")
    if not ids:
        raise RequestError(f"continuation={quote(c)} tokenises to no tokens", "continuation")
    return list(ids)


def _prompt_ids(d: dict, tokenizer, vocab_size: int, chat: ChatFormat | None,
                ids_name: str = "prompt_token_ids") -> tuple[list[int], bool, list[int]]:
    """The prompt's ids, whether it offers tools, and the start of a call it ends with (ids_name:
    what the line called prompt_token_ids)."""
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if k in d]
    if len(given) != 1:
        raise RequestError(f"give exactly one of prompt, messages, prompt_token_ids (got {given or 'none'})")
    if "messages" not in d and (d.get("tools") is not None or d.get("tool_choice") is not None):
        raise RequestError("tools and tool_choice go with messages", "tools" if "tools" in d else "tool_choice")
    if "prompt_token_ids" in d:
        ids = d["prompt_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RequestError(f"{ids_name} must be a list of integers", ids_name)
        outside = next((k for k, i in enumerate(ids) if not 0 <= i < vocab_size), None)
        if outside is not None:
            raise RequestError(f"{ids_name}[{outside}]={quote(ids[outside])} is outside the "
                               f"vocabulary of {vocab_size} ids (0 to {vocab_size - 1})", ids_name)
        return ids, False, []
    if tokenizer is None:
        raise RequestError("this checkpoint has no tokenizer; send prompt_token_ids instead of text")
    if "prompt" in d:
        if not isinstance(d["prompt"], str):
            raise RequestError("prompt must be a string", "prompt")
        return (tokenizer.encode(d["prompt"]) if d["prompt"] else []), False, []
    msgs = _about("messages", chat_tools.check_messages, d["messages"])
    tools = _about("tools", chat_tools.check_tools, d["tools"]) if d.get("tools") is not None else None
    choice = _about("tool_choice", chat_tools.check_tool_choice, d.get("tool_choice"), tools)
    if choice.mode == "none":
        tools = None  # left out of the prompt; calls in the history are still rendered
    ids, prefix = _about("messages", (chat or TemplateChat(tokenizer)).prompt, msgs, tools, choice, d)
    return ids, tools is not None, prefix


def iter_lines(path: str):
    """The file's non-blank lines, read as they come (constant memory): a generator, whose errors
    come as it is read (RequestFileError). Lines end at \\n alone (a \\r before it is dropped):
    JSON text may hold U+2028 and other characters that str.splitlines would break at. A line that
    is not UTF-8 is kept, so that it gets its own error result and the others are answered."""
    if not path:
        raise RequestFileError("io.input is empty: pass --config.io.input=<requests.jsonl>")
    check_bucket(path, "io.input")
    try:
        with epath.Path(path).open("rb") as f:
            for n, raw in enumerate(f, 1):
                raw = raw.removesuffix(b"\n").removesuffix(b"\r")
                text = (raw.removeprefix(b"\xef\xbb\xbf") if n == 1 else raw).decode("utf-8", "surrogateescape")
                if text.strip():
                    yield Line(n, text)
    except FileNotFoundError as e:
        raise RequestFileError(f"io.input={path}: no such file") from e
    except IsADirectoryError as e:
        raise RequestFileError(f"io.input={path} is a folder, not a file of requests") from e
    except OSError as e:
        raise RequestFileError(f"io.input={path}: cannot read it ({type(e).__name__}: {e})") from e


def read_lines(path: str) -> list[Line]:
    """The file's non-blank lines (iter_lines'), all of them: a file of none is an error."""
    out = list(iter_lines(path))
    if not out:
        raise RequestFileError(f"io.input={path} holds no requests (every line is blank)")
    return out
