"""What podrun's own format (podrun.py) and OpenAI Batch (openai_batch.py) share: a request file's
lines, the request a line's fields make (`Parsed`, by `parse_fields`, or the error it gets as a
value: errors.RequestError naming its field), and a request's answer, its completions read once
(`Answer`, by `build_answer`: the tokens decoded, cut at stop strings, a chat's completion read
by its chat format, runner/text/chat.py), which each format writes as its own result line.

A request's fields, in podrun's names (an OpenAI Batch body is renamed into them): one of prompt,
messages, prompt_token_ids; max_tokens, temperature, top_p, top_k, stop, seed, n, logprobs
(top_logprobs), prompt_logprobs, continuation, for chats tools and tool_choice
(runner/text/tools.py), and a format (response_format, guided_json, guided_regex, guided_choice:
runner/text/structured.py). Each line is decoded once; a line that cannot be served becomes an
error value, never an exception that ends the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable
from typing import Any

from etils import epath

from runner.engine import Completion, Request
from runner.engine.sampling import MAX_LOGPROBS  # alternatives per token the programs compute
from runner.errors import RequestError, RequestFileError, quote
from runner.settings import Settings
from runner.storage import check_bucket
from runner.text import structured
from runner.text import tools as chat_tools
from runner.text.chat import ChatFormat, TemplateChat

INT32_MAX = 2**31 - 1
MAX_N = 128  # samples per request


# --- the request file's lines ----------------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class Line:
    """A non-blank line of the request file; `decoded` its JSON object, read once."""

    number: int  # 1-based, blank lines counted, as an editor shows it: messages and default ids
    text: str  # UTF-8; bytes that are not UTF-8 kept as lone surrogates (surrogateescape)

    @functools.cached_property
    def decoded(self) -> tuple[dict | None, str]:
        """The line's JSON object, or None and the one-line reason it is not one."""
        where = f"line {self.number}"
        try:
            self.text.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = len(self.text[: e.start].encode("utf-8", "surrogateescape")) + 1
            return None, f"{where} is not UTF-8 (byte {byte} of the line)"
        try:
            d = json.loads(self.text)
        except json.JSONDecodeError as e:
            return None, f"{where} is not valid JSON: {e.msg} (column {e.colno})"
        except RecursionError:
            return None, f"{where} is JSON nested too deeply to read"
        if not isinstance(d, dict):
            return None, f"{where} is not a JSON object"
        return d, ""

    def release(self) -> None:
        """Drops the decoded object once the line is parsed (a file's objects take far more
        memory than its text)."""
        self.__dict__.pop("decoded", None)


def iter_lines(path: str):
    """The file's non-blank lines, read as they come (constant memory): a generator, whose errors
    come as it is read (RequestFileError). Lines end at \\n alone (a \\r before it is dropped):
    JSON text may hold U+2028 and other characters that str.splitlines would break at. A line that
    is not UTF-8 is kept, so that it gets its own error result and the others are answered."""
    if not path:
        raise RequestFileError("io.input is empty: pass --config.io.input=<requests.jsonl>")
    check_bucket(path, "io.input", RequestFileError)
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


# --- a request's fields -> the request it makes ----------------------------------------------------

@dataclasses.dataclass
class Parsed:
    """A request as its line's fields make it: what the engine runs (`request`) and what its answer
    needs, or (`error`) why it cannot be served."""

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


def _number(d: dict, key: str, default: Any, kind: type, lo: float | None = None,
            hi: float | None = None, above: bool = False, name: str = "") -> Any:
    """d[key] as a `kind` in [lo, hi] (lo excluded when `above`), default when absent or null; a
    RequestError naming the field (`name`, as the line gave it; key by default), the value and
    the range."""
    name = name or key
    if (v := d.get(key)) is None:
        return default
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


def parse_fields(index: int, number: int, d: dict, rid: Any, tokenizer, s: Settings, vocab_size: int,
                 chat: ChatFormat | None = None, grammars: structured.Grammars | None = None,
                 names: dict[str, str] | None = None) -> Parsed:
    """A request's fields (line `number`'s, answered as `rid`) -> a request or its error.
    names: {field: what the line called it} where the line's format names a field otherwise
    (an OpenAI chat's max_completion_tokens): errors name the field as the line gave it."""
    g, samp = s.generation, s.sampling
    max_tokens_name = (names or {}).get("max_tokens", "max_tokens")
    try:
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
        return failed(index, rid, number, e)
    # A request's random stream is its own seed's, wherever it stands in the file and whatever
    # runs beside it; without one, sampling.seed's mixed with the request's line number.
    row_seed = (seed if d.get("seed") is not None else samp.seed * 1_000_003 + number) % (2**32)
    return Parsed(index, rid, tuple(ids), "", max_tokens, temperature, top_k, top_p,
                  tuple(stop) + s.generation.stop, row_seed, chat="messages" in d, n=n,
                  logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  continuation=len(continuation), tools=offered, call_prefix=tuple(prefix),
                  constraint=constraint, line=number)


def failed(index: int, rid: Any, number: int, e: Exception) -> Parsed:
    """Request `rid` (line `number`'s) carrying error e as its result: one line of at most 400
    characters, whatever the library that raised it wrote."""
    message = str(e) if isinstance(e, ValueError | TypeError) else f"{type(e).__name__}: {e}"
    message = " ".join(message.split())
    return Parsed(index, rid, error=message if len(message) <= 400 else message[:397] + "...",
                  code=getattr(e, "code", "invalid_request"), param=getattr(e, "field", None), line=number)


def sizes(d: dict, max_new_tokens: int) -> tuple[int, int]:
    """(n, max_tokens) of a request's fields `d` as parse_fields reads them (max_new_tokens:
    generation's), without tokenising anything; the defaults where a value is not one it serves."""
    def read(key: str, default: int, lo: int, hi: int) -> int:
        try:
            return _number(d, key, default, int, lo, hi)
        except RequestError:  # the request gets an error result; the default stands for it
            return default

    return read("n", 1, 1, MAX_N), read("max_tokens", 0 if "continuation" in d else max_new_tokens, 0,
                                          max_new_tokens)


def refuse_repeated(ids: Iterable[tuple[Any, str]], key: str, what: str) -> None:
    """A RequestFileError naming the ids (id, or None for none, and its line as named) that more
    than one line carries, compared as JSON values, and their lines: results are matched to
    requests by id. `key`: the results' field of the id; `what`: a request of the file's format."""
    where: dict[str, list[str]] = {}
    for rid, line in ids:
        if rid is not None:
            where.setdefault(json.dumps(rid, sort_keys=True), []).append(line)
    repeated = [(c, ns) for c, ns in where.items() if len(ns) > 1]
    if repeated:
        shown = "; ".join(f"{quote(json.loads(c))} on lines {', '.join(map(str, ns[:10]))}"
                          for c, ns in repeated[:5])
        more = f"; and {len(repeated) - 5} more" if len(repeated) > 5 else ""
        raise RequestFileError(f"io.input: {len(repeated)} {key}(s) given more than once, but each "
                               f"{what} needs its own: {shown}{more}")


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
    elif is_ids(c):
        ids = _in_vocabulary(c, vocab_size, "continuation")
    else:
        raise RequestError(f"continuation={quote(c)}: give a string or a list of token ids", "continuation")
    if not ids:
        raise RequestError(f"continuation={quote(c)} tokenises to no tokens", "continuation")
    return list(ids)


def is_ids(x: Any) -> bool:
    """Whether x is a list of token ids as JSON gives them: integers, not booleans."""
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def _in_vocabulary(ids: list[int], vocab_size: int, name: str) -> list[int]:
    """ids, or a RequestError naming field `name` and the first id outside the vocabulary."""
    outside = next((k for k, i in enumerate(ids) if not 0 <= i < vocab_size), None)
    if outside is not None:
        raise RequestError(f"{name}[{outside}]={quote(ids[outside])} is outside the "
                           f"vocabulary of {vocab_size} ids (0 to {vocab_size - 1})", name)
    return ids


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
        if not is_ids(d["prompt_token_ids"]):
            raise RequestError(f"{ids_name} must be a list of integers", ids_name)
        return _in_vocabulary(d["prompt_token_ids"], vocab_size, ids_name), False, []
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



# --- a request's answer ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Token:
    """A token's log-probability under the model, and (`top`) the most likely tokens in its place,
    most likely first, each a Token without alternatives of its own."""

    id: int
    text: str | None  # decoded alone, special tokens spelt out; None without a tokenizer
    logprob: float
    top: tuple[Token, ...] = ()


@dataclasses.dataclass(frozen=True)
class Choice:
    """One sample's completion, as read: what every wire format writes of it."""

    text: str  # cut before a stop string; a chat's: the answer outside any calls
    token_ids: tuple[int, ...]  # ending with the token that completed a stop string
    finish_reason: str  # stop | length | tool_calls (calls read from a completion that ended)
    incomplete_format: bool = False  # max_tokens came before the format was whole
    reasoning: str | None = None  # Harmony's analysis channel
    commentary: str | None = None  # Harmony's commentary channel
    # the completion broke its chat format; raw: its text, special tokens and all (both or neither)
    chat_format_error: str | None = None
    raw: str | None = None
    # OpenAI's tool call objects (tools.tool_call), the shape both formats write calls in
    tool_calls: tuple[dict, ...] = ()
    logprobs: tuple[Token, ...] | None = None  # per token, when asked


@dataclasses.dataclass(frozen=True)
class Continuation:
    """A scored continuation (lm-eval-harness' loglikelihood): the sum of its tokens'
    log-probabilities, and whether greedy decoding would have produced it."""

    logprob: float
    is_greedy: bool
    token_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Answer:
    """A request's answer, independent of the wire format: one Choice per sample (n of them)."""

    id: Any  # the request's (a Batch line's custom_id)
    choices: tuple[Choice, ...]
    prompt_tokens: int
    prompt_logprobs: tuple[Token, ...] | None = None  # prompt tokens after the first, when asked
    continuation: Continuation | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # io.echo_prompt

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


def build_answer(p: Parsed, samples: list[Completion], tokenizer, echo: bool,
                 chat: ChatFormat | None = None) -> Answer:
    """Request p's answer from its samples' completions. `chat` reads chat completions (default:
    the tokenizer's template)."""
    chat = chat or (TemplateChat(tokenizer) if tokenizer is not None else None)
    choices = tuple(_choice(p, c, tokenizer, chat, sample=k) for k, c in enumerate(samples))
    scores = samples[0].prompt_logprobs
    prompt_logprobs = continuation = None
    # a request ended early (a deadline, cancelled) may not have computed its prompt: no scores
    if p.prompt_logprobs is not None and None not in scores:  # the first token has none
        prompt_logprobs = tuple(_token(t, x, p.prompt_logprobs, tokenizer)
                                for t, x in zip(p.prompt_ids[1:], scores))
    if p.continuation and None not in scores[len(scores) - p.continuation:]:
        tail = scores[len(scores) - p.continuation:]
        ids = p.prompt_ids[len(p.prompt_ids) - p.continuation:]
        continuation = Continuation(float(sum(float(x.logprob) for x in tail)),
                                    all(int(x.top_ids[0]) == t for x, t in zip(tail, ids)), tuple(ids))
    return Answer(p.id, choices, len(p.prompt_ids), prompt_logprobs, continuation,
                  tuple(p.prompt_ids) if echo else None)


def _choice(p: Parsed, c: Completion, tokenizer, chat: ChatFormat | None, sample: int = 0) -> Choice:
    """One sample's text, tokens, finish reason (and log-probabilities when asked); a chat's
    completion as its format reads it: with tools offered, the calls it made (text: what it wrote
    outside them) and finish_reason "tool_calls"."""
    # stop strings do not cut a completion under a format: the format says where it ends
    text, ids, stopped = cut_at_stop(tokenizer, c.token_ids, () if p.constraint else p.stop)
    finish = "stop" if stopped else c.finish_reason
    chat_fields: dict[str, Any] = {}
    if p.chat and chat is not None:
        reply = chat.reply(ids, text, p.call_prefix, p.tools, finish == "stop")
        text = reply.text
        chat_fields = dict(reasoning=reply.reasoning, commentary=reply.commentary,
                           chat_format_error=reply.error, raw=reply.raw if reply.error is not None else None)
        if reply.calls:  # read only from a completion that ended, not one cut off (its text stays as is)
            # a call's id hashes this key (the ids' list repr included): changing it changes call ids
            chat_fields["tool_calls"] = tuple(
                chat_tools.tool_call(name, args, f"{p.id!r}/{sample}/{k}/{ids}", valid)
                for k, (name, args, valid) in enumerate(reply.calls))
            finish = "tool_calls"
    logprobs = None
    if p.logprobs is not None:
        logprobs = tuple(_token(t, x, p.logprobs, tokenizer) for t, x in zip(ids, c.logprobs))
    return Choice(text, tuple(ids), finish, bool(c.incomplete_format), logprobs=logprobs, **chat_fields)


def _token(token: int, x, k: int, tokenizer) -> Token:
    """Token `token` with its log-probability and the k most likely in its place (x: its
    TokenLogprobs)."""
    def text(i: int) -> str | None:
        return tokenizer.decode([i], skip_special_tokens=False) if tokenizer else None

    return Token(int(token), text(int(token)), float(x.logprob),
                 tuple(Token(int(i), text(int(i)), float(lp))
                       for i, lp in zip(x.top_ids[:k], x.top_logprobs[:k])))


def cut_at_stop(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[str, list[int], bool]:
    """Decoded text, cut before the first stop string (ids cut after the token completing it)."""
    if tokenizer is None:
        return "", ids, False
    text = tokenizer.decode(ids)
    hits = [text.find(st) for st in stops if st in text]
    if not hits:
        return text, ids, False
    # the whole text holds a stop string, so some prefix of the ids does
    k = next(k for k in range(1, len(ids) + 1)
             if any(st in tokenizer.decode(ids[:k]) for st in stops))
    return text[: min(hits)], ids[:k], True

