"""Results built: a request's completions as the line of the results file, in podrun's format
(`result_line`) or as an OpenAI Batch result (batch.result_line, from the same line).

podrun's result line: {"id", "text", "token_ids", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}} (+ "logprobs", "prompt_logprobs", "continuation", "prompt_token_ids" when
asked, "tool_calls" when the model called a tool; "reasoning", "commentary" from Harmony), with
n > 1 {"id", "choices": [{"index", "text", ...}], "usage"}; a request that cannot be served
{"id", "error"}. A chat's completion is read by its chat format (runner/text/chat.py).
"""

from __future__ import annotations

from runner.api.requests import Parsed
from runner.engine import Completion
from runner.text.chat import ChatFormat, TemplateChat
from runner.text.tools import tool_call


def error_line(p: Parsed) -> dict:
    """podrun's result line of request p, which cannot be served (p.error)."""
    return {"id": p.id, "error": p.error}


def result_line(p: Parsed, samples: list[Completion], tokenizer, echo: bool,
                 chat: ChatFormat | None = None) -> dict:
    """The results file's line for request p and its samples' completions: one sample's fields
    at the top, several as `choices`. `chat` reads chat completions (default: the tokenizer's
    template)."""
    chat = chat or (TemplateChat(tokenizer) if tokenizer is not None else None)
    choices = [_choice(p, c, tokenizer, chat, sample=k) for k, c in enumerate(samples)]
    used = sum(len(c["token_ids"]) for c in choices)
    r = {"id": p.id, **choices[0]} if p.n == 1 else {
        "id": p.id, "choices": [{"index": k, **c} for k, c in enumerate(choices)]}
    r["usage"] = {"prompt_tokens": len(p.prompt_ids), "completion_tokens": used}
    scores = samples[0].prompt_logprobs
    if p.prompt_logprobs is not None:  # the first prompt token has nothing before it
        r["prompt_logprobs"] = [None] + [_logprob(t, x, p.prompt_logprobs, tokenizer)
                                         for t, x in zip(p.prompt_ids[1:], scores)]
    if p.continuation:  # lm-eval-harness' loglikelihood: its sum, and whether greedy decoding
        tail = scores[len(scores) - p.continuation:]  # would have produced it
        ids = p.prompt_ids[len(p.prompt_ids) - p.continuation:]
        r["continuation"] = {"logprob": float(sum(float(x.logprob) for x in tail)),
                             "is_greedy": all(int(x.top_ids[0]) == t for x, t in zip(tail, ids)),
                             "token_ids": list(ids)}
    if echo:
        r["prompt_token_ids"] = list(p.prompt_ids)
    return r


def _choice(p: Parsed, c: Completion, tokenizer, chat: ChatFormat | None, sample: int = 0) -> dict:
    """One sample's text, tokens, finish reason (and log-probabilities when asked); a chat's
    completion as its format reads it: with tools offered, the calls it made as `tool_calls`
    (text: what it wrote outside them) and finish_reason "tool_calls"."""
    # stop strings do not cut a completion under a format: the format says where it ends
    text, ids, stopped = cut_at_stop(tokenizer, c.token_ids, () if p.constraint else p.stop)
    r = {"text": text, "token_ids": ids, "finish_reason": "stop" if stopped else c.finish_reason}
    if c.incomplete_format:  # max_tokens came first: the text does not hold the whole format
        r["incomplete_format"] = True
    if p.chat and chat is not None:
        reply = chat.reply(ids, text, p.call_prefix, p.tools, r["finish_reason"] == "stop")
        r["text"] = reply.text
        r.update({k: v for k, v in (("reasoning", reply.reasoning), ("commentary", reply.commentary))
                  if v is not None})
        if reply.error is not None:
            r["chat_format_error"], r["raw"] = reply.error, reply.raw
        if reply.calls:  # read only from a completion that ended, not one cut off (its text stays as is)
            r["tool_calls"] = [tool_call(name, args, f"{p.id!r}/{sample}/{k}/{ids}", valid)
                               for k, (name, args, valid) in enumerate(reply.calls)]
            r["finish_reason"] = "tool_calls"
    if p.logprobs is not None:
        r["logprobs"] = {"content": [_logprob(t, x, p.logprobs, tokenizer)
                                     for t, x in zip(ids, c.logprobs)]}
    return r


def _logprob(token: int, x, k: int, tokenizer) -> dict:
    """Token `token`'s log-probability and the k most likely in its place (x: its
    TokenLogprobs), as OpenAI's chat completions give them, with the ids."""
    def text(i: int) -> str | None:
        return tokenizer.decode([i], skip_special_tokens=False) if tokenizer else None

    return {"id": int(token), "token": text(int(token)), "logprob": float(x.logprob),
            "top_logprobs": [{"id": int(i), "token": text(int(i)), "logprob": float(lp)}
                             for i, lp in zip(x.top_ids[:k], x.top_logprobs[:k])]}



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
