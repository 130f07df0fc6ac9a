"""Tools in chats: the request's function definitions, tool_choice and tool messages checked, and
tool calls read back out of completions written in a chat template's own syntax.

A request's tools are OpenAI function definitions,
    {"type": "function", "function": {"name", "description", "parameters": <JSON schema>}},
its history may hold assistant calls,
    {"role": "assistant", "content": null, "tool_calls": [{"id", "type": "function",
     "function": {"name", "arguments": "<a JSON object, as a string>"}}]},
and their results, {"role": "tool", "tool_call_id", "content", "name"?}. A call read from a
completion is an OpenAI tool call, {"id": "call_...", "type": "function", "function": {"name",
"arguments"}}, with "invalid_arguments": true where its arguments are not JSON (kept as written).

Template syntaxes (read off the template's own text, which tells the model how to call):
    hermes       Qwen2.5: <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block a call
    llama3_json  Llama 3.1: the reply is {"name": ..., "parameters": {...}} (after <|python_tag|>
                 when the model writes it; ";" between several)
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from typing import Any, NamedTuple

import jsonschema

from runner.errors import quote

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
TOOL_CHOICES = ("auto", "none", "required")


class ToolChoice(NamedTuple):
    mode: str  # auto | none (the tools left out of the prompt) | required | function
    name: str = ""  # the function to call, for mode function


def check_tools(tools: Any) -> list[dict]:
    """The request's `tools`, checked: a list of OpenAI function definitions, each `parameters` a
    JSON schema (Draft 2020-12's meta-schema), names unique. Raises ValueError naming the field."""
    if not isinstance(tools, list):
        raise ValueError(f"tools={quote(tools)}: give a list of function definitions")
    names = set()
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f'{where}: give {{"type": "function", "function": {{"name", "description", '
                             '"parameters"}}')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name={quote(name)}: 1 to 64 letters, digits, _ or -")
        if name in names:
            raise ValueError(f"{where}.function.name={quote(name)} is defined twice")
        names.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        params = f.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise ValueError(f"{where}.function.parameters is not a JSON schema (give an object)")
            if problem := _schema_problem(json.dumps(params, sort_keys=True)):
                raise ValueError(f"{where}.function.parameters is not a JSON schema: {problem}")
    return tools


@functools.cache
def _meta_validator() -> jsonschema.protocols.Validator:
    """Draft 2020-12's meta-schema validator, as its check_schema builds it (once, not per call)."""
    meta = jsonschema.Draft202012Validator.META_SCHEMA
    cls = jsonschema.validators.validator_for(meta, default=jsonschema.Draft202012Validator)
    return cls(meta, format_checker=cls.FORMAT_CHECKER)


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str:
    """Why a schema (as sorted JSON) fails Draft 2020-12's meta-schema ("" when it passes), as
    check_schema reports it: its first error. Cached: a job's requests share their tools."""
    for e in _meta_validator().iter_errors(json.loads(schema_json)):
        path = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in e.absolute_path)
        return f"{' '.join(e.message.split())[:120]} (at parameters{path})"
    return ""


def check_tool_choice(choice: Any, tools: list[dict] | None) -> ToolChoice:
    """The request's tool_choice: "auto", "none", "required" or {"type": "function", "function":
    {"name"}} (one of the tools). Raises ValueError naming the field."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, dict):
        f = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(f, dict) and isinstance(f.get("name"), str)):
            raise ValueError(f'tool_choice={quote(choice)}: give "auto", "none", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        if f["name"] not in {t["function"]["name"] for t in tools or ()}:
            raise ValueError(f"tool_choice.function.name={quote(f['name'])} is not one of the tools")
        return ToolChoice("function", f["name"])
    if choice not in TOOL_CHOICES:
        raise ValueError(f'tool_choice={quote(choice)}: use "auto", "none", "required" or a function')
    if choice != "none" and not tools:
        raise ValueError(f"tool_choice={quote(choice)} needs tools")
    return ToolChoice(choice)


def call_prefix(syntax: str, choice: ToolChoice) -> str:
    """The start of a call that the prompt writes for the model, so that it must call: up to the
    function's name for "required", up to its arguments for a named function ("" for auto). It
    ends where the templates' tokenizers split anyway (before a word, after a colon), so the
    model's next token is one it would have written there."""
    if choice.mode in ("auto", "none"):
        return ""
    head, args = {"hermes": ('<tool_call>\n{"name": "', "arguments"),
                  "llama3_json": ('{"name": "', "parameters")}[syntax]
    return head if choice.mode == "required" else f'{head}{choice.name}", "{args}":'


ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def check_messages(msgs: Any) -> list[dict]:
    """The chat's messages, checked: every message a {role, content: str}, but for an assistant
    message with `tool_calls` (content then may be null or absent) and a `tool` message (which
    answers an earlier call by `tool_call_id`). Raises ValueError naming the field
    (`messages[3].tool_call_id`)."""
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("messages must be a non-empty list of {role: str, content: str}")
    calls: dict[str, str] = {}  # id -> function name, of the calls made so far
    for k, m in enumerate(msgs):
        where = f"messages[{k}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where} must be an object {{role: str, content: str}}")
        if m["role"] not in ROLES:  # a template would render any name, and the model read it as text
            raise ValueError(f"{where}.role={quote(m['role'])} is not a chat role: give one of "
                             f"{', '.join(ROLES)}")
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            tool_calls = m["tool_calls"]
            if not isinstance(tool_calls, list) or not tool_calls:
                raise ValueError(f"{where}.tool_calls must be a non-empty list")
            for j, c in enumerate(tool_calls):
                calls[_check_call(c, f"{where}.tool_calls[{j}]")] = c["function"]["name"]
            if content is not None and not isinstance(content, str):
                raise ValueError(f"{where}.content must be a string or null")
            continue
        if not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string")
        if m["role"] == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise ValueError(f"{where}.tool_call_id must be a string: the id of the call it answers")
            if cid not in calls:
                raise ValueError(f"{where}.tool_call_id={quote(cid)} matches no tool call of an earlier "
                                 "assistant message")
            if m.get("name") is not None and m["name"] != calls[cid]:
                raise ValueError(f"{where}.name={quote(m['name'])} is not the function of call {cid!r} "
                                 f"({calls[cid]!r})")
    return msgs


def _check_call(c: Any, where: str) -> str:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        raise ValueError(f'{where}: give {{"id", "type": "function", "function": {{"name", "arguments"}}}}')
    if c.get("type", "function") != "function":
        raise ValueError(f"{where}.type={quote(c['type'])}: only function calls are supported")
    if not isinstance(c.get("id"), str) or not c["id"]:
        raise ValueError(f"{where}.id must be a non-empty string")
    name, args = c["function"].get("name"), c["function"].get("arguments")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    if not isinstance(args, str):
        raise ValueError(f"{where}.function.arguments={quote(args)} is not a JSON string (OpenAI "
                         "sends the arguments object encoded as a string)")
    try:
        decoded = json.loads(args)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}.function.arguments is not valid JSON: {e.msg} "
                         f"(column {e.colno})") from None
    if not isinstance(decoded, dict):
        raise ValueError(f"{where}.function.arguments={quote(args)} is not a JSON object")
    return c["id"]


def template_messages(msgs: list[dict]) -> list[dict]:
    """The messages as a chat template is given them: each call's arguments decoded into an object.
    transformers passes messages to the template as they are, and its tool-use guide gives the
    arguments as a dict; the templates write `arguments | tojson`, so a JSON string would be
    printed quoted and escaped, which is not what the models were trained to read (vLLM decodes
    them too)."""
    out = []
    for m in msgs:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": json.loads(c["function"]["arguments"])}}
                                     for c in m["tool_calls"]]}
        out.append(m)
    return out


# --- calls in completions -------------------------------------------------------------------------


def call_syntax(template: str | None) -> str | None:
    """The tool-call syntax a chat template asks for: "hermes" (<tool_call> blocks, Qwen2.5),
    "llama3_json" (a bare {"name", "parameters"} object, Llama 3.1), or None (unknown)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template and "<|start_header_id|>" in template:
        return "llama3_json"
    return None


def tool_call(name: str, arguments: str, key: str, valid: bool = True) -> dict:
    """An OpenAI tool call. `key` (request id, sample, position) makes its id: the same completion
    gets the same ids on every run."""
    out = {"id": "call_" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:24],
           "type": "function", "function": {"name": name, "arguments": arguments}}
    return out if valid else {**out, "invalid_arguments": True}


def _call_json(body: str, args_key: str) -> tuple[str, str, bool] | None:
    """(name, arguments, valid) of a call written as {"name": ..., args_key: {...}}; None when no
    name can be read. Arguments that are not JSON are kept as written."""
    try:
        d = json.loads(body)
    except json.JSONDecodeError:
        d = None
    if isinstance(d, dict) and isinstance(d.get("name"), str):
        args = d.get(args_key, d.get("arguments", {}))
        return d["name"], json.dumps(args, ensure_ascii=False), True
    m = re.fullmatch(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"' + args_key + r'"\s*:\s*(.*?)\}?\s*', body,
                     re.DOTALL)
    return (m[1], m[2].strip(), False) if m else None


def parse_calls(text: str, syntax: str) -> tuple[str, list[tuple[str, str, bool]]]:
    """(the text outside the calls, [(name, arguments, valid)]) of a completion's text."""
    if syntax == "hermes":
        calls, kept, pos = [], [], 0
        for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
            call = _call_json(m[1], "arguments")
            if call is None:
                continue  # not a call podrun can name: stays in the text
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return "".join(kept).strip() if calls else text, calls
    if syntax == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                d, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                d = None
            if not (isinstance(d, dict) and isinstance(d.get("name"), str)):
                if calls:  # text after the calls: not a reply of calls alone
                    return text, []
                call = _call_json(body, "parameters")  # one call, its arguments not JSON
                return (text, []) if call is None else ("", [call])
            args = d.get("parameters", d.get("arguments", {}))
            calls.append((d["name"], json.dumps(args, ensure_ascii=False), True))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return "", calls
    raise ValueError(f"unknown tool-call syntax {syntax!r}")
