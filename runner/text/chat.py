"""Chat formats: how a chat's messages and tools become prompt ids, and how a completion's ids are
read back into text, reasoning and tool calls.

Two formats: a checkpoint's Jinja chat template (`TemplateChat`: tools as transformers' template
variable, calls in Qwen2.5's or Llama 3.1's syntax, tools.py), and GPT-OSS's Harmony
(`HarmonyChat`: channels, calls to `functions.NAME`, harmony.py). `chat_format` picks one per
checkpoint; everything downstream (the request parser, the result builder, the structured-output
grammars, the engine's stop ids) asks the format, never which format it is.
"""

from __future__ import annotations

import dataclasses
import json

from runner.errors import RequestError
from runner.text import harmony
from runner.text import tools as chat_tools


@dataclasses.dataclass
class Reply:
    """A chat completion read back: `text` the answer (outside any calls); `calls` (name,
    arguments, arguments are JSON) read from a completion that ended; the rest only where the
    format has them."""

    text: str
    calls: list[tuple[str, str, bool]] = dataclasses.field(default_factory=list)
    reasoning: str | None = None  # Harmony's analysis channel
    commentary: str | None = None  # Harmony's commentary channel (or the preamble of calls)
    error: str | None = None  # the completion broke the format (Harmony), or "incomplete"
    raw: str | None = None  # with an error: the completion's text, special tokens and all


class ChatFormat:
    """The interface. `stop_ids`: the ids that end a completion; `format_stop_ids(stop_ids)`: the
    ids that may end a completion held to a structured format, which is complete before them;
    `grammar_start`: the Lark start rule over a format's `body` (structured.py) for a chat."""

    stop_ids: tuple[int, ...] = ()
    grammar_start = "start: body\n"

    def format_stop_ids(self, stop_ids: tuple[int, ...]) -> tuple[int, ...]:
        return stop_ids

    def prompt(self, messages: list[dict], tools: list[dict] | None, choice: chat_tools.ToolChoice,
               request: dict) -> tuple[list[int], list[int]]:
        """(the prompt's ids, the start of a call it ends with). `messages` and `tools` are
        checked (tools.check_*); tools None: none offered. tool_choice "required" or a named
        function ends the prompt with the start of the call (tools.call_prefix)."""
        raise NotImplementedError

    def reply(self, ids: list[int], text: str, call_prefix: tuple[int, ...], tools: bool,
              stopped: bool) -> Reply:
        """The completion `ids` (its `text` already cut at stop strings) of a chat whose prompt
        ended with `call_prefix`; calls are read when `tools` were offered and it `stopped`."""
        raise NotImplementedError


class TemplateChat(ChatFormat):
    """A checkpoint's own chat template (or checkpoint.chat_template's), rendered as transformers'
    apply_chat_template(messages, tools=tools, add_generation_prompt=True) renders it."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stop_ids = tuple(tokenizer.eos_token_ids)

    def prompt(self, messages, tools, choice, request):
        tok = self.tokenizer
        template = tok.chat_template_for(tools)
        syntax = chat_tools.call_syntax(template) if tools is not None else None
        if tools is not None and syntax is None:
            raise RequestError("tools: this checkpoint's chat template " + (
                "does not render tools" if "tools" not in (template or "") else "asks for a tool-call "
                "syntax podrun cannot read (it reads Qwen2.5's <tool_call> blocks and Llama 3.1's JSON "
                "calls)") + "; give one that does in checkpoint.chat_template", "tools")
        ids = tok.encode_chat(chat_tools.template_messages(messages), add_generation_prompt=True, tools=tools)
        # the template's own text up to the generation prompt, then the call's start as its own text
        head = chat_tools.call_prefix(syntax, choice) if syntax else ""
        prefix = tok.encode(head, add_special_tokens=False) if head else []
        return ids + prefix, prefix

    def reply(self, ids, text, call_prefix, tools, stopped):
        syntax = chat_tools.call_syntax(self.tokenizer.chat_template_for([]))
        if not (tools and stopped) or syntax is None:
            return Reply(text)
        head = self.tokenizer.decode(call_prefix) if call_prefix else ""
        text, calls = chat_tools.parse_calls(head + text, syntax)
        return Reply(text, calls)


class HarmonyChat(ChatFormat):
    """GPT-OSS's Harmony, as openai-harmony renders and parses it; a chat ends on <|return|> (an
    answer) or <|call|> (a tool call), and a structured format goes in the final channel, after an
    optional analysis message."""

    stop_ids = tuple(harmony.STOP_TOKEN_IDS)
    grammar_start = ('start: (<|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> '
                     '"assistant")? <|channel|> "final" <|message|> body\n')

    def __init__(self, tokenizer, reasoning_effort: str = "medium"):
        self.tokenizer, self.reasoning_effort = tokenizer, reasoning_effort

    def format_stop_ids(self, stop_ids):
        return (harmony.RETURN,)  # an answer, not a tool call

    def prompt(self, messages, tools, choice, request):
        effort = request.get("reasoning_effort", self.reasoning_effort)
        if effort not in ("low", "medium", "high"):
            raise RequestError(f"reasoning_effort={effort!r}: use low, medium or high", "reasoning_effort")
        ids = harmony.render(messages, self.tokenizer, harmony.HarmonyOptions(reasoning_effort=effort), tools)
        prefix = harmony.call_prefix(self.tokenizer, choice)
        return list(ids) + prefix, prefix

    def reply(self, ids, text, call_prefix, tools, stopped):
        h = harmony.parse([*call_prefix, *ids], self.tokenizer)
        r = Reply(h.text, reasoning=h.reasoning)
        if tools and h.calls and stopped:  # arguments go in tool_calls
            r.calls = [(name, args, _is_json(args)) for name, args in h.calls]
            r.commentary = h.preamble or None
        elif h.commentary:
            r.commentary = h.commentary
        if h.error or not h.complete:
            r.error, r.raw = h.error or "incomplete", h.raw
        return r


def chat_format(family: str, tokenizer, reasoning_effort: str = "medium") -> ChatFormat | None:
    """The chat format of a checkpoint of model `family` with this tokenizer (None without one:
    its requests give prompt_token_ids)."""
    if tokenizer is None:
        return None
    return HarmonyChat(tokenizer, reasoning_effort) if family == "gptoss" else TemplateChat(tokenizer)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True

