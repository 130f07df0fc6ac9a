"""GPT-OSS's Harmony chat format: chat rendering and completion parsing, over the o200k_harmony
vocabulary (o200k.py).

References: openai-harmony (`src/encoding.rs`: the renderer, `StreamableParser`), which is not
needed at run time.

A chat renders as
    <|start|>system<|message|>{identity, cutoff, date, reasoning, channels}<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system prompt}<|end|>
    <|start|>user<|message|>{question}<|end|>
    <|start|>assistant
and the model completes it with
    <|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|return|>
With tools, the developer message also declares them (`# Tools ... namespace functions {...}`),
and a call and its result read
    <|start|>assistant to=functions.NAME<|channel|>commentary <|constrain|>json<|message|>{args}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>{result}<|end|>
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Sequence

from runner.text.o200k import (CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, SPECIAL_TOKENS, START,
                               STOP_TOKEN_IDS, VOCAB_SIZE, ordinary_encoder)

# --- rendering ------------------------------------------------------------------------------------

_EFFORTS = ("low", "medium", "high")
_CHANNELS = ("analysis", "commentary", "final")


@dataclasses.dataclass(frozen=True)
class HarmonyOptions:
    """The Harmony system message. "" leaves a line out (openai-harmony's None)."""

    reasoning_effort: str = "medium"  # low | medium | high
    knowledge_cutoff: str = "2024-06"
    conversation_date: str = ""  # "Current date: ..." ("2025-08-05"); openai-harmony omits it too
    model_identity: str = "You are ChatGPT, a large language model trained by OpenAI."

    def __post_init__(self):
        if self.reasoning_effort not in _EFFORTS:
            raise ValueError(f"reasoning_effort={self.reasoning_effort!r}; expected one of {_EFFORTS}")

    def system_text(self, function_tools: bool = False) -> str:
        top = [self.model_identity, self.knowledge_cutoff and f"Knowledge cutoff: {self.knowledge_cutoff}",
               self.conversation_date and f"Current date: {self.conversation_date}"]
        channels = f"# Valid channels: {', '.join(_CHANNELS)}. Channel must be included for every message."
        if function_tools:
            channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
        sections = ["\n".join(s for s in top if s), f"Reasoning: {self.reasoning_effort}", channels]
        return "\n\n".join(s for s in sections if s)


@dataclasses.dataclass(frozen=True)
class _Turn:
    """One Harmony message: <|start|>{author}[ to={recipient}][<|channel|>{channel}][ {content_type}]
    <|message|>{text}<|end|> (<|call|> for an assistant's call)."""

    author: str  # a role, or for a tool's result the tool's name ("functions.get_weather")
    text: str
    channel: str | None = None
    recipient: str | None = None
    constrain: str | None = None  # "json": the content type <|constrain|>json


def render(messages: list[dict], tokenizer, options: HarmonyOptions = HarmonyOptions(),
           tools: list[dict] | None = None) -> list[int]:
    """OpenAI-style chat messages -> Harmony prompt ids ending in `<|start|>assistant`, as
    openai-harmony's render_conversation_for_completion(..., Role.ASSISTANT) renders

        [system: SystemContent(options)] + messages mapped as
        system | developer -> developer: DeveloperContent.with_instructions(content)
                 (the first message, when it is one, also .with_function_tools(tools); else a
                 developer message of the tools alone goes first)
        user -> user: content
        assistant -> assistant, channel analysis: its "thinking" / "reasoning" / "reasoning_content"
                     (if any), then its content on its "channel" (default final, commentary when it
                     has tool_calls; left out when empty and reasoning or calls were given), then
                     each call: channel commentary, recipient functions.NAME, content type
                     <|constrain|>json, the arguments as written
        tool -> author functions.NAME (NAME: the function of the call it answers), recipient
                assistant, channel commentary: content

    `tools` are OpenAI function definitions (runner.text.tools.check_tools), each becoming
    ToolDescription(name, description or "", parameters). Raises ValueError (TypeError for
    non-string content) for a message it cannot render."""
    if tokenizer.token_to_id("<|start|>") != START or tokenizer.token_to_id("<|call|>") != CALL:
        raise ValueError("Harmony needs the o200k_harmony tokenizer (<|start|> = 200006); this "
                         "checkpoint's tokenizer is another")
    turns = [_Turn("system", options.system_text(function_tools=bool(tools)))]
    namespace = _functions_namespace(json.dumps(tools)) if tools else ""
    if namespace and (not messages or messages[0].get("role") not in ("system", "developer")):
        turns.append(_Turn("developer", namespace))
    called: dict[str, str] = {}  # call id -> function name
    for k, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        calls = m.get("tool_calls") or [] if role == "assistant" else []
        if not isinstance(content, str) and not (calls and content is None):
            raise TypeError(f"message {k}: content must be a string, got {type(content).__name__}")
        if role in ("system", "developer"):
            text = f"# Instructions\n\n{content}"
            turns.append(_Turn("developer", f"{text}\n\n{namespace}" if namespace and k == 0 else text))
        elif role == "user":
            turns.append(_Turn("user", content))
        elif role == "assistant":
            channel = m.get("channel") or ("commentary" if calls else "final")
            if channel not in _CHANNELS:
                raise ValueError(f"message {k}: channel {channel!r}; expected one of {_CHANNELS}")
            reasoning = next((m[f] for f in ("thinking", "reasoning", "reasoning_content")
                              if m.get(f) is not None), None)
            if reasoning is not None and not isinstance(reasoning, str):
                raise TypeError(f"message {k}: reasoning must be a string")
            if reasoning:
                turns.append(_Turn("assistant", reasoning, "analysis"))
            if content or not (reasoning or calls):
                turns.append(_Turn("assistant", content, channel))
            for c in calls:
                name = c["function"]["name"]
                called[c.get("id")] = name
                turns.append(_Turn("assistant", c["function"]["arguments"], "commentary",
                                   f"functions.{name}", "json"))
        elif role == "tool":
            name = called.get(m.get("tool_call_id")) or m.get("name")
            if not name:
                raise ValueError(f"message {k}: a tool result that answers no earlier call")
            turns.append(_Turn(f"functions.{name}", content, "commentary", "assistant"))
        else:
            raise ValueError(f"message {k}: role {role!r} is not supported; use system, developer, "
                             "user, assistant or tool")
    # openai-harmony's auto_drop_analysis: when the last assistant message is final, the analysis
    # messages before the *first* final message are dropped (later ones stay).
    last_is_final = next((t.channel == "final" for t in reversed(turns) if t.author == "assistant"), False)
    first_final = next((k for k, t in enumerate(turns) if t.channel == "final"), len(turns))
    ids = []
    for k, t in enumerate(turns):
        if last_is_final and k < first_final and t.channel == "analysis":
            continue
        ids += [START, *_encode_fixed(tokenizer, t.author)]
        if t.recipient is not None:
            ids += _encode_fixed(tokenizer, f" to={t.recipient}")
        if t.channel is not None:
            ids += [CHANNEL, *_encode_fixed(tokenizer, t.channel)]
        if t.constrain is not None:
            ids += [*_encode_fixed(tokenizer, " "), CONSTRAIN, *_encode_fixed(tokenizer, t.constrain)]
        end = CALL if t.author == "assistant" and t.recipient is not None else END
        text = (_encode_fixed if t.author in ("system", "developer") else _encode)(tokenizer, t.text)
        ids += [MESSAGE, *text, end]
    return ids + [START, *_encode_fixed(tokenizer, "assistant")]


def call_prefix(tokenizer, choice) -> list[int]:
    """The header that makes the assistant's next message a call (choice: a
    runner.text.tools.ToolChoice): to any function for "required" (the model writes ".NAME":
    o200k splits before the dot, not after), to functions.NAME for a named one ([] for auto)."""
    if choice.mode in ("auto", "none"):
        return []
    if choice.mode == "required":
        return [CHANNEL, *_encode_fixed(tokenizer, "commentary to=functions")]
    return [CHANNEL, *_encode_fixed(tokenizer, f"commentary to=functions.{choice.name}"),
            *_encode_fixed(tokenizer, " "), CONSTRAIN, *_encode_fixed(tokenizer, "json"), MESSAGE]


@functools.lru_cache(maxsize=64)
def _functions_namespace(tools_json: str) -> str:
    """openai-harmony's tools section for the "functions" namespace (template_tools_section), of
    the tools as JSON (a job's requests mostly share theirs)."""
    lines = ["## functions\n", "namespace functions {\n"]
    for t in json.loads(tools_json):
        f = t["function"]
        lines += [f"// {line}" for line in _lines(f.get("description") or "")]
        params = f.get("parameters")
        signature = f"(_: {_typescript(params, '')})" if params is not None else "()"
        lines.append(f"type {f['name']} = {signature} => any;\n")
    lines.append("} // namespace functions")
    return "# Tools\n\n" + "\n".join(lines)


def _lines(text: str) -> list[str]:
    """Rust's str::lines: split at \\n, a trailing \\r dropped from each, no empty last line."""
    parts = text.split("\n")
    if parts[-1] == "":
        parts.pop()
    return [p.removesuffix("\r") for p in parts]


def _json(v) -> str:
    """serde_json's Display of a value: compact JSON, non-ASCII as is."""
    return json.dumps(v, ensure_ascii=False, separators=(",", ":"))


def _default(schema: dict, enum_raw: bool = True) -> str | None:
    """The "default: ..." comment of a schema (None when it has no default): a string default in
    quotes, but bare (enum_raw) or as JSON (not enum_raw) for an enum's."""
    if "default" not in schema:
        return None
    d = schema["default"]
    if isinstance(d, str) and not _is_enum(schema):
        return f'default: "{d}"'
    return f"default: {d}" if isinstance(d, str) and enum_raw else f"default: {_json(d)}"


def _is_enum(schema: dict) -> bool:
    return isinstance(schema.get("enum"), list) and bool(schema["enum"])


def _nullable(schema: dict, ts: str) -> str:
    return f"{ts} | null" if schema.get("nullable") is True and "null" not in ts else ts


def _typescript(schema, indent: str) -> str:
    """openai-harmony's json_schema_to_typescript: a JSON schema as a TypeScript-like type."""
    if not isinstance(schema, dict):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return "".join("\n" + _variant(v, indent, enum_raw=False) for v in one_of)
    ty = schema.get("type")
    if isinstance(ty, list):
        names = ["number" if t == "integer" else t for t in ty if isinstance(t, str)]
        if names:
            return " | ".join(names)
        ty = None
    if ty == "object":
        return _object(schema, indent)
    if ty == "string":
        enums = [f'"{v}"' for v in schema.get("enum") or [] if isinstance(v, str)] if isinstance(
            schema.get("enum"), list) else []
        return " | ".join(enums) if enums else "string"
    if ty in ("number", "integer"):
        return "number"
    if ty == "boolean":
        return "boolean"
    if ty == "array":
        return f"{_typescript(schema['items'], indent)}[]" if "items" in schema else "Array<any>"
    return "any"


def _object(schema: dict, indent: str) -> str:
    out = f"{indent}// {schema['description']}\n" if isinstance(schema.get("description"), str) else ""
    out += "{\n"
    props = schema.get("properties")
    required = {r for r in schema.get("required") or [] if isinstance(r, str)} if isinstance(
        schema.get("required"), list) else set()
    for key, val in (props.items() if isinstance(props, dict) else ()):
        val = val if isinstance(val, dict) else {}
        optional = "" if key in required else "?"
        if isinstance(val.get("title"), str):
            out += f"{indent}// {val['title']}\n{indent}//\n"
        one_of = val.get("oneOf")
        if one_of is None and isinstance(val.get("description"), str):
            out += f"{indent}// {val['description']}\n"
        if isinstance(val.get("examples"), list) and val["examples"]:
            out += f"{indent}// Examples:\n"
            out += "".join(f'{indent}// - "{ex}"\n' for ex in val["examples"] if isinstance(ex, str))
        if isinstance(one_of, list):
            out += _one_of_property(key, optional, val, one_of, indent)
            continue
        out += f"{indent}{key}{optional}: {_nullable(val, _typescript(val, indent + '    '))},"
        if one_of is None and (d := _default(val)) is not None:
            out += f" // {d}"
        out += "\n"
    return out + f"{indent}}}"


def _one_of_property(key: str, optional: str, val: dict, variants: list, indent: str) -> str:
    desc = val["description"] if isinstance(val.get("description"), str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    desc_above = desc is not None and first.get("description") != desc
    out = f"{indent}// {desc}\n" if desc_above else ""
    if (d := _default(val)) is not None:
        out += f"{indent}// {d}\n"
    out += f"{indent}{key}{optional}:\n"
    for i, variant in enumerate(variants):
        out += _variant(variant, indent, described=i > 0 or not desc_above, hidden=desc) + "\n"
    return out + f"{indent},\n"


def _variant(variant, indent: str, enum_raw: bool = True, described: bool = True,
             hidden: str | None = None) -> str:
    """One ` | type // notes` line of a oneOf, its notes: its description (where `described`,
    and not the `hidden` one) and its default."""
    variant = variant if isinstance(variant, dict) else {}
    description = variant.get("description")
    shown = described and isinstance(description, str) and description != hidden
    notes = [description] if shown else []
    if (d := _default(variant, enum_raw)) is not None:
        notes.append(d)
    out = f"{indent} | {_nullable(variant, _typescript(variant, indent + '   '))}"
    return out + (f" // {' '.join(notes)}" if notes else "")


def _encode(tokenizer, text: str) -> list[int]:
    if "<|" in text and "|>" in text:  # may hold special-token text, which stays plain text
        return ordinary_encoder().encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


@functools.lru_cache(maxsize=512)
def _encode_fixed(tokenizer, text: str) -> tuple[int, ...]:
    """_encode for the texts every request repeats (headers, the system message, the developer
    message with its tools): a tokenizer call costs ~60 us whatever the text's length."""
    return tuple(_encode(tokenizer, text))


# --- parsing --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Channels:
    """A completion by channel. Several messages on one channel are joined by a newline."""

    text: str  # the final channel's content ("" if none)
    reasoning: str  # the analysis channel's content
    commentary: str  # the commentary channel's content (preambles, tool call arguments)
    complete: bool  # a final message closed by <|return|> / <|end|>, or a tool call by <|call|>
    error: str  # "" when the completion kept to the grammar; else why not ("; "-joined)
    raw: str  # the whole completion, special tokens kept
    # Messages to a function ("to=functions.NAME") that were closed: (NAME, their content).
    calls: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    preamble: str = ""  # the commentary channel's messages that are not calls


_HEADER_ENDS = frozenset((MESSAGE, START, END, RETURN, CALL))
_CONTENT_ENDS = frozenset((END, RETURN, CALL, START, CHANNEL))  # the last two: <|end|> left out


def parse(completion_ids: Sequence[int], tokenizer) -> Channels:
    """Splits a completion of a prompt that `render` ended with `<|start|>assistant` into its
    channels, as openai-harmony's parse_messages_from_completion_tokens(..., Role.ASSISTANT)
    does. Never raises: a completion cut off, or out of the grammar, keeps what could be read
    and says what went wrong in `error`. The answer ends at the first <|return|> or <|call|>."""
    ids = [int(i) for i in completion_ids]
    errors = [] if ids else ["empty completion"]
    if any(not 0 <= i < VOCAB_SIZE for i in ids):
        errors.append("ids outside the vocabulary (left out)")
        ids = [i for i in ids if 0 <= i < VOCAB_SIZE]
    by_channel: dict[str, list[str]] = {c: [] for c in _CHANNELS}
    calls, preamble = [], []
    complete, n, pos = False, len(ids), 0
    needs_role = False  # the prompt wrote the first message's "<|start|>assistant"
    while pos < n:
        # Header: [assistant]<|channel|>name[ to=recipient][ [<|constrain|>]type], up to <|message|>.
        end = pos
        while end < n and ids[end] not in _HEADER_ENDS:
            end += 1
        if end == n:
            errors.append("cut off in a message header")
            break
        header = _decode(tokenizer, ids[pos:end])
        if ids[end] == START:
            errors.append(f"malformed header {header + '<|start|>'!r}")
            pos, needs_role = end + 1, True  # resynchronise on the next message
            continue
        channel, key, rest, problem = _header(header, needs_role)
        where = f"the {channel} channel" if channel else "a message"
        if ids[end] == MESSAGE:  # content, up to <|end|> / <|return|> / <|call|>
            body = stop = end + 1
            # A <|start|> or <|channel|> in it: the model began a message without closing this one.
            while stop < n and ids[stop] not in _CONTENT_ENDS:
                stop += 1
            text = _decode(tokenizer, ids[body:stop])
            if strays := sorted({SPECIAL_TOKENS[i] for i in ids[body:stop] if i in SPECIAL_TOKENS}):
                problem = problem or f"{', '.join(strays)} inside {where}"  # kept as text, as there
        else:  # closed before <|message|>: the header's words are the content (strict=False there)
            stop, text = end, " ".join(rest)
            problem = problem or f"no <|message|> in the header of {where}"
        if problem:
            errors.append(problem)
        if key is not None:
            by_channel[key].append(text)
        if stop == n:
            errors.append(f"cut off in {where}")
            break
        last = ids[stop]
        recipient = _recipient(rest) if ids[end] == MESSAGE and key is not None else None
        if recipient and recipient.startswith("functions.") and last in (END, RETURN, CALL):
            calls.append((recipient.removeprefix("functions."), text))
        elif key == "commentary":
            preamble.append(text)
        if last in (START, CHANNEL):
            errors.append(f"{SPECIAL_TOKENS[last]} before <|end|> in {where}")
            pos, needs_role = (stop + 1, True) if last == START else (stop, False)
            continue
        if last in STOP_TOKEN_IDS or stop + 1 == n:  # the end of the completion
            complete = last == CALL or key == "final"
            if not complete:
                errors.append(f"ended after {where} without a final message")
            if stop + 1 < n:
                complete = False
                errors.append(f"tokens after {SPECIAL_TOKENS[last]}")
            break
        if ids[stop + 1] != START:
            errors.append(f"{_decode(tokenizer, ids[stop + 1 : stop + 2])!r} after <|end|>, "
                          "not <|start|>")
            pos, needs_role = stop + 1, False
            continue
        pos, needs_role = stop + 2, True
        if pos == n:
            errors.append("cut off in a message header")
    return Channels(text="\n".join(by_channel["final"]), reasoning="\n".join(by_channel["analysis"]),
                  commentary="\n".join(by_channel["commentary"]), complete=complete,
                  error="; ".join(dict.fromkeys(errors)), raw=_decode(tokenizer, ids), calls=calls,
                  preamble="\n".join(preamble))


def _header(header: str, needs_role: bool) -> tuple[str | None, str | None, list[str], str]:
    """A message header, read as openai-harmony's parse_header_from_string reads it: (channel,
    the channel its content counts for or None to drop it, the words left, problem)."""
    channel = None
    if (at := header.find("<|channel|>")) >= 0:
        rest = header[at + len("<|channel|>") :]
        channel = re.match(r"[^\s<]*", rest)[0] or None
        header = header[:at] + rest[len(channel or "") :]
    parts = header.replace("<|constrain|>", " <|constrain|>").split()
    if parts[:1] == ["assistant"]:
        parts = parts[1:]
    elif needs_role:
        return channel, None, parts, f"a message header {header.strip()!r} without the assistant role"
    key = channel if channel in _CHANNELS else None
    # What may remain: a recipient ("to=functions.f") and a content type ("<|constrain|>json").
    if len(parts) > 2 or any("<|" in p and not p.startswith("<|constrain|>") for p in parts):
        return channel, key, parts, f"malformed header {header!r}"
    if channel is None:
        return None, "final", parts, "a message without a channel"  # read as the answer
    if key is None:
        return channel, None, parts, f"unknown channel {channel!r}"
    return channel, key, parts, ""


def _recipient(parts: list[str]) -> str | None:
    """The recipient among a header's words after its role and channel, as openai-harmony's
    parse_header_from_string reads it: the last word when it is "to=..." or alone, else the word
    before the content type."""
    if not parts:
        return None
    if parts[-1].startswith("to=") or len(parts) == 1:
        return parts[-1].removeprefix("to=")
    return parts[-2].removeprefix("to=")


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)
