"""Results built: a request's completions read once into an `Answer` (`build_answer`: the tokens
decoded, cut at stop strings, a chat's completion read by its chat format, runner/text/chat.py),
which each wire format writes as its own line: podrun's (`podrun_line`) or an OpenAI Batch
result (batch.result_line).

podrun's result line: {"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}} (+ "logprobs", "prompt_logprobs", "continuation", "prompt_token_ids" when
asked, "tool_calls" when the model called a tool; "reasoning", "commentary" from Harmony), with
n > 1 {"id", "choices": [{"index", "text", ...}], "usage"}; a request that cannot be served
{"id", "error"}.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from runner.api.requests import Parsed
from runner.engine import Completion
from runner.text.chat import ChatFormat, TemplateChat
from runner.text.tools import tool_call


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
    if p.prompt_logprobs is not None:  # the first prompt token has nothing before it
        prompt_logprobs = tuple(_token(t, x, p.prompt_logprobs, tokenizer)
                                for t, x in zip(p.prompt_ids[1:], scores))
    if p.continuation:
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
            chat_fields["tool_calls"] = tuple(tool_call(name, args, f"{p.id!r}/{sample}/{k}/{ids}", valid)
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
    for k in range(1, len(ids) + 1):
        if any(st in tokenizer.decode(ids[:k]) for st in stops):
            ids = ids[:k]
            break
    return text[: min(hits)], ids, True


# --- podrun's lines ---------------------------------------------------------------------------------

def error_line(p: Parsed) -> dict:
    """podrun's result line of request p, which cannot be served (p.error)."""
    return {"id": p.id, "error": p.error}


def podrun_line(a: Answer) -> dict:
    """podrun's result line of answer a: one sample's fields at the top, several as `choices`."""
    choices = [_podrun_choice(c) for c in a.choices]
    r = {"id": a.id, **choices[0]} if len(choices) == 1 else {
        "id": a.id, "choices": [{"index": k, **c} for k, c in enumerate(choices)]}
    r["usage"] = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens}
    if a.prompt_logprobs is not None:
        r["prompt_logprobs"] = [None] + [_podrun_token(t) for t in a.prompt_logprobs]
    if a.continuation is not None:
        x = a.continuation
        r["continuation"] = {"logprob": x.logprob, "is_greedy": x.is_greedy, "token_ids": list(x.token_ids)}
    if a.prompt_token_ids is not None:
        r["prompt_token_ids"] = list(a.prompt_token_ids)
    return r


def _podrun_choice(c: Choice) -> dict:
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
        r["logprobs"] = {"content": [_podrun_token(t) for t in c.logprobs]}
    return r


def _podrun_token(t: Token) -> dict:
    """As OpenAI's chat completions give a token's log-probabilities, with the ids."""
    return {"id": t.id, "token": t.text, "logprob": t.logprob,
            "top_logprobs": [{"id": a.id, "token": a.text, "logprob": a.logprob} for a in t.top]}
