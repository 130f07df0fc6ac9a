"""Tools in chats against the references: Harmony prompts and tool-call parses against openai-harmony;
Qwen2.5's and Llama 3.1's own chat templates (tests/data, from llama.cpp's models/templates, which
copies them verbatim from the Hugging Face repos Qwen/Qwen2.5-7B-Instruct and
meta-llama/Llama-3.1-8B-Instruct) against transformers' apply_chat_template(tools=...); the calls
read back against the templates' own rendering of them; result lines against the openai package's
types."""

from __future__ import annotations

import json
import os

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    Role,
    StreamableParser,
    SystemContent,
    ToolDescription,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from runner.engine import Completion
from runner.api import common, podrun
from runner.api.common import Line
from runner.text.chat import HarmonyChat, chat_format
from runner.text.harmony import HarmonyOptions, parse, render
from runner.text.tokenizer import load_tokenizer, read_chat_template
from tests import test_harmony
from tests.test_requests import messages as fuzz_messages
from tests.test_requests import tools as fuzz_tools
from tests.test_tokenizer import ids_of, shakespeare_lines, write_folder


def _result_line(p, samples, tok, echo, chat=None) -> dict:
    """podrun's result line of request p and its samples, as runner.job writes it."""
    return podrun.result_line(common.build_answer(p, samples, tok, echo, chat))


DATA = os.path.join(os.path.dirname(__file__), "data")
# o200k_harmony: podrun's tokenizer (tok) and openai-harmony's encoding (enc), over one vocabulary
vocab_dir, enc, tok = test_harmony.vocab_dir, test_harmony.enc, test_harmony.tok

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}},
        "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search-web", "description": "Searches the web.\nReturns the top hits.",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "title": "Query", "examples": ["jax pallas", "tpu v5e"]},
        "limit": {"type": "integer", "default": 5, "description": "How many hits"},
        "sites": {"type": "array", "items": {"type": "string"}},
        "filters": {"type": "object", "description": "Narrow the hits", "properties": {
            "lang": {"type": ["string", "null"]}, "safe": {"type": "boolean", "nullable": True}}},
        "when": {"description": "Time range", "oneOf": [
            {"type": "string", "enum": ["day", "week"], "description": "Time range", "default": "day"},
            {"type": "object", "properties": {"from": {"type": "string"}}, "description": "From a date"}]},
        "anything": {}, "tags": {"type": "array"}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no description, no parameters
TOOLS = [WEATHER, SEARCH, NOW]


def call(cid, name, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def user(text):
    return {"role": "user", "content": text}


CONVERSATIONS = {
    "question": [user("What's the weather in Paris?")],
    "system_question": [{"role": "system", "content": "You are terse."}, user("Weather in Paris and Oslo?")],
    "one_call_and_result": [
        user("Weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'}],
    "calls_across_turns": [
        {"role": "system", "content": "Use the tools."}, user("Weather in Paris, then search."),
        {"role": "assistant", "tool_calls": [call("c1", "get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "21 C"},
        {"role": "assistant", "content": "", "tool_calls": [call("c2", "search-web", {"query": "Paris 日本"})]},
        {"role": "tool", "tool_call_id": "c2", "content": "[]"},
        {"role": "assistant", "content": "Nothing found; it is 21 C."}, user("Thanks. And now?")],
}
# Qwen2.5 writes several calls in one message; Llama 3.1's template refuses them.
SEVERAL_CALLS = [
    user("Weather in Paris and Oslo?"),
    {"role": "assistant", "content": "Checking both.", "tool_calls": [
        call("a", "get_weather", {"city": "Paris"}),
        call("b", "get_weather", {"city": "Oslo", "unit": "fahrenheit"})]},
    {"role": "tool", "tool_call_id": "a", "content": "21"}, {"role": "tool", "tool_call_id": "b", "content": "50"}]


# --- Harmony (GPT-OSS) against openai-harmony ------------------------------------------------------

def harmony_reference(enc, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The openai-harmony conversation that `render` documents as its equivalent."""
    conv = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new())]
    described = [ToolDescription.new(t["function"]["name"], t["function"].get("description") or "",
                                     t["function"].get("parameters")) for t in tools or ()]
    first_is_system = messages[0]["role"] == "system"
    if tools and not first_is_system:
        tools_only = DeveloperContent.new().with_function_tools(described)
        conv.append(Message.from_role_and_content(Role.DEVELOPER, tools_only))
    names = {}
    for k, m in enumerate(messages):
        if m["role"] == "system":
            dev = DeveloperContent.new().with_instructions(m["content"])
            conv.append(Message.from_role_and_content(
                Role.DEVELOPER, dev.with_function_tools(described) if tools and k == 0 else dev))
        elif m["role"] == "user":
            conv.append(Message.from_role_and_content(Role.USER, m["content"]))
        elif m["role"] == "tool":
            author = Author.new(Role.TOOL, f"functions.{names[m['tool_call_id']]}")
            conv.append(Message.from_author_and_content(author, m["content"]).with_recipient("assistant")
                        .with_channel("commentary"))
        else:
            if m.get("content"):
                channel = "commentary" if m.get("tool_calls") else "final"
                conv.append(Message.from_role_and_content(Role.ASSISTANT, m["content"]).with_channel(channel))
            for c in m.get("tool_calls") or ():
                names[c["id"]] = c["function"]["name"]
                conv.append(Message.from_role_and_content(Role.ASSISTANT, c["function"]["arguments"])
                            .with_channel("commentary").with_recipient(f"functions.{c['function']['name']}")
                            .with_content_type("<|constrain|>json"))
    return enc.render_conversation_for_completion(Conversation.from_messages(conv), Role.ASSISTANT)


@pytest.mark.parametrize("name", [*CONVERSATIONS, "several_calls"])
@pytest.mark.parametrize("tools", [TOOLS, [WEATHER], None], ids=["three_tools", "one_tool", "no_tools"])
def test_harmony_tool_prompts_match_openai_harmony(tok, enc, name, tools):
    messages = SEVERAL_CALLS if name == "several_calls" else CONVERSATIONS[name]
    ids = render(messages, tok, HarmonyOptions(), tools)
    want = harmony_reference(enc, messages, tools)
    assert ids == want, f"\n{tok.decode(ids, skip_special_tokens=False)}\n---\n{enc.decode(want)}"


SCHEMAS = {
    "empty_object": {"type": "object", "properties": {}},
    "no_type": {"properties": {"a": {"type": "string"}}},
    "described_nested": {"type": "object", "description": "Top", "properties": {"inner": {
        "type": "object", "description": "Inner one", "properties": {"x": {"type": "number", "default": 1.5}},
        "required": ["x"]}, "list": {"type": "array", "items": {"type": "object", "properties": {
            "k": {"type": "string", "default": "v \"q\""}}}}}},
    "top_level_one_of": {"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                                   {"type": "string", "enum": ["x"], "default": "x", "description": "Just x"},
                                   {"type": "integer", "nullable": True}]},
    "property_one_of_descriptions": {"type": "object", "properties": {"p": {
        "description": "Shared", "default": {"k": [1, 2]}, "oneOf": [
            {"type": "string", "description": "Shared"}, {"type": "number", "description": "Other",
                                                          "default": 3}, {"type": "boolean"}]}}},
    "property_one_of_without_match": {"type": "object", "required": ["p"], "properties": {"p": {
        "description": "Outer", "oneOf": [{"type": "string", "description": "Inner"},
                                          {"type": "null", "nullable": True}]}}},
    "enum_defaults": {"type": "object", "properties": {
        "e": {"type": "string", "enum": ["a", "b"], "default": "a"},
        "n": {"type": "integer", "enum": [1, 2], "default": 2},
        "b": {"type": "boolean", "default": False}, "u": {"type": "string", "default": "ünï"}}},
    "type_lists": {"type": "object", "properties": {"t": {"type": ["integer", "string", "null"]},
                                                    "empty": {"type": []}}},
    "unicode_and_lines": {"type": "object", "description": "Línea uno", "properties": {
        "名前": {"type": "string", "description": "名前を入力"}}},
}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_harmony_function_declarations_match_openai_harmony(tok, enc, schema):
    tools = [{"type": "function", "function": {"name": "f", "description": "Does f.\r\n\nTwice\n",
                                               "parameters": SCHEMAS[schema]}}]
    messages = [{"role": "system", "content": "Be brief."}, user("go")]
    assert render(messages, tok, HarmonyOptions(), tools) == harmony_reference(enc, messages, tools)


TOOL_COMPLETIONS = {
    "call_after_analysis": '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
                           '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                           '{"city": "Paris"}<|call|>',
    "call_only": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}'
                 '<|call|>',
    "recipient_before_channel": ' to=functions.search-web<|channel|>commentary <|constrain|>json<|message|>'
                                '{"query": "x"}<|call|>',
    "no_content_type": '<|channel|>commentary to=functions.now<|message|>{}<|call|>',
    "preamble_then_call": '<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>'
                          'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
                          '<|call|>',
    "call_on_analysis": '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>'
                        '{"city": "Lima"}<|call|>',
    "invalid_json": '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": Paris'
                    '<|call|>',
    "answer_no_call": '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>'
                      '4<|return|>',
}


def harmony_calls(messages) -> list[tuple[str, str]]:
    """openai-harmony's messages to a function, as (name, content)."""
    return [(m.recipient.removeprefix("functions."), m.content[0].text) for m in messages
            if (m.recipient or "").startswith("functions.")]


@pytest.mark.parametrize("name", TOOL_COMPLETIONS)
def test_harmony_calls_match_openai_harmonys_parser(tok, enc, name):
    ids = enc.encode(TOOL_COMPLETIONS[name], allowed_special="all")
    p = parse(ids, tok)
    assert p.calls == harmony_calls(enc.parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    assert (bool(p.calls), p.complete, p.error) == (name != "answer_no_call", True, "")


@pytest.mark.parametrize("name", ["call_after_analysis", "preamble_then_call"])
def test_harmony_cut_off_calls_are_what_openai_harmony_finished(tok, enc, name):
    """A completion cut off anywhere holds the calls openai-harmony's StreamableParser has finished."""
    ids = enc.encode(TOOL_COMPLETIONS[name], allowed_special="all")
    for k in range(len(ids) + 1):
        parser = StreamableParser(enc, Role.ASSISTANT)
        for i in ids[:k]:
            parser.process(i)
        assert parse(ids[:k], tok).calls == harmony_calls(parser.messages), k


def harmony_request(tok, s, request: dict):
    """A request line parsed as a GPT-OSS deployment parses it (runner.job.chat_format's Harmony)."""
    return podrun.parse_line(0, Line(1, json.dumps(request)), tok, s, 201_088,
                         chat_format("gptoss", tok, s.generation.reasoning_effort))


def test_harmony_request_line_to_tool_calls(tok, enc, s):
    """A request line with tools renders as openai-harmony does; a completion that calls a function
    comes back as OpenAI tool_calls with finish_reason tool_calls, its preamble as commentary."""
    messages = CONVERSATIONS["one_call_and_result"]
    p = harmony_request(tok, s, {"id": "h", "messages": messages, "tools": TOOLS})
    assert not p.error and p.tools and list(p.prompt_ids) == harmony_reference(enc, messages, TOOLS)
    ids = enc.encode(TOOL_COMPLETIONS["preamble_then_call"], allowed_special="all")
    r = _result_line(p, [Completion(ids, "stop")], tok, False, HarmonyChat(tok))
    assert (r["finish_reason"], r["text"], r["commentary"]) == ("tool_calls", "", "Let me look.")
    [c] = r["tool_calls"]
    assert ChatCompletionMessageFunctionToolCall.model_validate(c).function.name == "get_weather"
    assert json.loads(c["function"]["arguments"]) == {"city": "Rome"} and c["id"].startswith("call_")
    bad = enc.encode(TOOL_COMPLETIONS["invalid_json"], allowed_special="all")
    [c] = _result_line(p, [Completion(bad, "stop")], tok, False, HarmonyChat(tok))["tool_calls"]
    assert (c["function"]["arguments"], c["invalid_arguments"]) == ('{"city": Paris', True)


def test_harmony_results_without_tools_are_unchanged(tok, enc, s):
    """tool_choice none leaves the tools out of the prompt and the calls in the commentary, as a
    request without tools has them."""
    messages = CONVERSATIONS["question"]
    plain = harmony_request(tok, s, {"messages": messages})
    none = harmony_request(tok, s, {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    assert none.prompt_ids == plain.prompt_ids == tuple(harmony_reference(enc, messages, None))
    ids = enc.encode(TOOL_COMPLETIONS["call_only"], allowed_special="all")
    for p in (plain, none):
        r = _result_line(p, [Completion(ids, "stop")], tok, False, HarmonyChat(tok))
        assert "tool_calls" not in r and (r["finish_reason"], r["commentary"]) == ("stop", '{"city":"Oslo"}')


# --- the checkpoints' own chat templates, against transformers --------------------------------------

# SmolLM2-135M-Instruct's chat template, as its GGUF and tokenizer_config.json carry it
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                    "{% endif %}")
FAMILIES = {  # template (a file in tests/data, or the text), special tokens (then plain added tokens), tokenizer_config.json
    "qwen2.5": ("qwen2.5-instruct.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                ["<tool_call>", "</tool_call>"], {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "llama3.1": ("llama-3.1-instruct.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], [],
                 {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    # SmolLM2's own template renders no tools; served with checkpoint.chat_template set to the
    # shipped ChatML template that does (the reference: transformers given the same template)
    "smollm2+chatml_tools": (SMOLLM2_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             ["<tool_call>", "</tool_call>"], {"eos_token": "<|im_end|>"}),
}
GIVEN_TEMPLATE = {"smollm2+chatml_tools": os.path.join(DATA, "..", "..", "configs", "templates",
                                                       "chatml_tools.jinja")}


def template_tokenizer(d, name: str, text: list[str] = ()) -> str:
    """A folder in d holding a small byte-level BPE (trained on Shakespeare, then `text`) that
    carries the family's special tokens and its chat template."""
    template, special, added, config = FAMILIES[name]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*shakespeare_lines(400), *text], trainer)
    tok.add_tokens(added)
    if template.endswith(".jinja"):
        with open(os.path.join(DATA, template), encoding="utf-8") as f:
            template = f.read()
    config = {**config, "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    return write_folder(d, {"tokenizer.json": tok.to_str(), "tokenizer_config.json": config})


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, podrun's tokenizer, transformers' PreTrainedTokenizerFast) of template_tokenizer's,
    both given the config's template where the family has one."""
    folder = template_tokenizer(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    given = GIVEN_TEMPLATE.get(request.param, "")
    if given:
        with open(given, encoding="utf-8") as f:
            hf.chat_template = f.read()
    return request.param, load_tokenizer(folder, read_chat_template(given)), hf


def as_template_gets_them(messages: list[dict]) -> list[dict]:
    """The messages with each call's arguments as an object, as transformers' tool-use guide
    writes them (and as the templates' `arguments | tojson` expects)."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


@pytest.fixture(scope="module")
def s():
    from configs.cpu import get_config
    from runner.settings import from_config

    c = get_config("/unused")
    c.generation.max_prompt_len, c.generation.max_new_tokens = 4096, 16
    return from_config(c)


def request(tok, s, d: dict):
    return podrun.parse_line(0, Line(1, json.dumps(d)), tok, s, tok.vocab_size)


@pytest.mark.parametrize("name", [*CONVERSATIONS, "several_calls"])
@pytest.mark.parametrize("tools", [TOOLS, [WEATHER], None], ids=["three_tools", "one_tool", "no_tools"])
def test_template_tool_prompts_match_apply_chat_template(family, s, name, tools):
    fam, tok, hf = family
    messages = SEVERAL_CALLS if name == "several_calls" else CONVERSATIONS[name]
    p = request(tok, s, {"messages": messages} | ({"tools": tools} if tools else {}))
    if fam == "llama3.1" and name == "several_calls":
        assert p.error == "the chat template failed: This model only supports single tool-calls at once!"
        return
    want = hf.apply_chat_template(as_template_gets_them(messages), tools=tools, add_generation_prompt=True,
                                  tokenize=True)
    assert not p.error and p.tools == bool(tools)
    assert list(p.prompt_ids) == ids_of(want), (
        tok.decode(p.prompt_ids, skip_special_tokens=False))


def completion_of(hf, messages: list[dict], reply: dict) -> str:
    """The text the template writes for `reply` after the chat's generation prompt: what a model
    trained on it completes."""
    before = hf.apply_chat_template(as_template_gets_them(messages), tools=TOOLS, add_generation_prompt=True,
                                    tokenize=False)
    after = hf.apply_chat_template(as_template_gets_them([*messages, reply]), tools=TOOLS, tokenize=False)
    assert after.startswith(before)
    return after[len(before):]


REPLIES = {
    "one_call": {"role": "assistant",
                 "tool_calls": [call("x", "get_weather", {"city": "Zürich", "unit": "celsius"})]},
    "no_arguments": {"role": "assistant", "tool_calls": [call("x", "now", {})]},
    "nested_arguments": {"role": "assistant", "tool_calls": [call("x", "search-web", {
        "query": "a \"b\"\n", "sites": ["x.org"], "filters": {"lang": None, "safe": True}, "limit": 3})]},
    "text_and_two_calls": SEVERAL_CALLS[1],  # Qwen2.5 only
}


@pytest.mark.parametrize("reply", REPLIES)
def test_template_calls_are_read_back(family, s, reply):
    """A completion written as the template writes an assistant's calls is read back into those
    calls (name and arguments), the text outside them as the text, finish_reason tool_calls."""
    fam, tok, hf = family
    messages, want = CONVERSATIONS["question"], REPLIES[reply]
    if fam == "llama3.1" and len(want["tool_calls"]) > 1:
        return
    text = completion_of(hf, messages, want)
    p = request(tok, s, {"id": 7, "messages": messages, "tools": TOOLS})
    r = _result_line(p, [Completion(tok.encode(text, add_special_tokens=False), "stop")], tok, False)
    assert r["finish_reason"] == "tool_calls" and r["text"] == (want.get("content") or "")
    calls = [ChatCompletionMessageFunctionToolCall.model_validate(c) for c in r["tool_calls"]]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want["tool_calls"]]
    assert len({c.id for c in calls}) == len(calls) and all("invalid_arguments" not in c for c in r["tool_calls"])


@pytest.mark.parametrize("fam,text,name,arguments", [
    ("qwen2.5", '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
     "get_weather", '{"city": Paris}'),
    ("qwen2.5", 'Sure.\n<tool_call>\n{"name": "now", "arguments": {"a": 1,}}\n</tool_call>', "now", '{"a": 1,}'),
    ("llama3.1", '{"name": "get_weather", "parameters": {"city": "Paris"', "get_weather", '{"city": "Paris"'),
    ("llama3.1", '<|python_tag|>{"name": "now", "parameters": {"x": 1,}}', "now", '{"x": 1,}'),
])
def test_arguments_that_are_not_json_are_kept_and_flagged(family, s, fam, text, name, arguments):
    if family[0] != fam:
        return
    _, tok, _ = family
    p = request(tok, s, {"messages": CONVERSATIONS["question"], "tools": TOOLS})
    ids = tok.encode(text, add_special_tokens=False)
    [c] = _result_line(p, [Completion(ids, "stop")], tok, False)["tool_calls"]
    assert (c["function"]["name"], c["function"]["arguments"], c["invalid_arguments"]) == (name, arguments, True)


def test_llama_python_tag_and_several_calls(family, s):
    fam, tok, hf = family
    if fam != "llama3.1":
        return
    p = request(tok, s, {"messages": CONVERSATIONS["question"], "tools": TOOLS})
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "now", "parameters": {}}'
    r = _result_line(p, [Completion(tok.encode(text, add_special_tokens=False), "stop")], tok, False)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in r["tool_calls"]] == [
        ("get_weather", {"city": "A"}), ("now", {})]


def test_template_results_without_tools_are_unchanged(family, s):
    """Without tools (or with tool_choice none, which leaves them out of the prompt) a completion
    that looks like a call stays text, as before."""
    fam, tok, hf = family
    messages = CONVERSATIONS["question"]
    text = completion_of(hf, messages, REPLIES["one_call"])
    ids = tok.encode(text, add_special_tokens=False)
    plain = request(tok, s, {"messages": messages})
    none = request(tok, s, {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    assert none.prompt_ids == plain.prompt_ids and not none.tools
    for p in (plain, none):
        r = _result_line(p, [Completion(ids, "stop")], tok, False)
        assert "tool_calls" not in r and r["finish_reason"] == "stop" and r["text"] == tok.decode(ids)


def test_a_call_cut_off_is_text(family, s):
    fam, tok, hf = family
    text = completion_of(hf, CONVERSATIONS["question"], REPLIES["one_call"])
    ids = tok.encode(text, add_special_tokens=False)[:-6]
    p = request(tok, s, {"messages": CONVERSATIONS["question"], "tools": TOOLS})
    r = _result_line(p, [Completion(ids, "length")], tok, False)
    assert "tool_calls" not in r and r["finish_reason"] == "length" and r["text"] == tok.decode(ids)


# --- bad input ------------------------------------------------------------------------------------

Q = CONVERSATIONS["question"]
BAD = [
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools[0].function.parameters is not a JSON schema: "),
    ({"messages": Q, "tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"minLength": -1}}}}}]},
     "tools[1].function.parameters is not a JSON schema: -1 is less than the minimum of 0 (at parameters"
     "['properties']['a']['minLength'])"),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters is not a JSON schema (give an object)"),
    ({"messages": Q, "tools": [{"name": "f"}]}, 'tools[0]: give {"type": "function", "function"'),
    ({"messages": Q, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 'tools[0].function.name="a b"'),
    ({"messages": Q, "tools": [WEATHER, WEATHER]}, 'tools[1].function.name="get_weather" is defined twice'),
    ({"messages": Q, "tools": {"a": 1}}, 'tools={"a": 1}: give a list of function definitions'),
    ({"messages": [*Q, {"role": "tool", "tool_call_id": "c9", "content": "1"}], "tools": TOOLS},
     'messages[1].tool_call_id="c9" matches no tool call of an earlier assistant message'),
    ({"messages": [*CONVERSATIONS["one_call_and_result"][:2],
                   {"role": "tool", "tool_call_id": "c2", "content": ""}]},
     'messages[2].tool_call_id="c2" matches no tool call'),
    ({"messages": [*Q, {"role": "tool", "content": "1"}]}, "messages[1].tool_call_id must be a string"),
    ({"messages": [*Q, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": {}}}]}]},
     "messages[1].tool_calls[0].function.arguments={} is not a JSON string"),
    ({"messages": [*Q, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{x"}}]}]},
     "messages[1].tool_calls[0].function.arguments is not valid JSON"),
    ({"messages": [*Q, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments=\"[1]\" is not a JSON object"),
    ({"messages": [*CONVERSATIONS["one_call_and_result"][:2],
                   {"role": "tool", "tool_call_id": "c1", "name": "now", "content": ""}]},
     "messages[2].name=\"now\" is not the function of call 'c1' ('get_weather')"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content must be a string"),
    ({"messages": Q, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     'tool_choice.function.name="nope" is not one of the tools'),
    ({"messages": Q, "tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}},
     'tool_choice={"type": "function", "name": "now"}: give "auto", "none", "required"'),
    ({"messages": Q, "tools": TOOLS, "tool_choice": "any"}, 'tool_choice="any": use "auto", "none", "required"'),
    ({"messages": Q, "tool_choice": "auto"}, 'tool_choice="auto" needs tools'),
    ({"messages": Q, "tool_choice": "required"}, 'tool_choice="required" needs tools'),
    ({"prompt": "hi", "tools": TOOLS}, "tools and tool_choice go with messages"),
    ({"messages": Q, "tools": TOOLS, "guided_choice": ["a"]},
     "guided_choice: a format and tools do not go together; give one"),
]


@pytest.mark.parametrize("line,error", BAD)
def test_bad_tools_and_tool_messages_name_the_field(family, s, line, error):
    assert request(family[1], s, line).error.startswith(error)


def test_templates_without_tools_refuse_them(s, tmp_path):
    from tests.test_tokenizer import TEMPLATE

    folder = write_folder(tmp_path, {"tokenizer.json": HFTokenizer(models.BPE({"a": 0, "<s>": 1}, [])).to_str(),
                                     "tokenizer_config.json": {"chat_template": TEMPLATE, "bos_token": "<s>"}})
    error = request(load_tokenizer(folder), s, {"messages": Q, "tools": TOOLS}).error
    assert error == ("tools: this checkpoint's chat template does not render tools; give one that does in "
                     "checkpoint.chat_template")


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(msgs=fuzz_messages, tools=fuzz_tools | st.just(TOOLS) | st.none(),
       choice=st.sampled_from(["auto", "none", "required", None]))
def test_any_chat_with_tools_gets_a_prompt_or_a_one_line_error(family, s, msgs, tools, choice):
    d = {"messages": msgs} | ({"tools": tools} if tools is not None else {}) | (
        {"tool_choice": choice} if choice else {})
    p = request(family[1], s, d)
    assert (p.error and "\n" not in p.error and len(p.error) <= 300) or (p.prompt_ids and not p.error), p


# --- tool_choice required / a named function: the prompt starts the call ---------------------------

FORCED = {  # the start of the call the template's own rendering of a call begins with
    ("qwen2.5", "required"): '<tool_call>\n{"name": "',
    ("qwen2.5", "get_weather"): '<tool_call>\n{"name": "get_weather", "arguments":',
    ("llama3.1", "required"): '{"name": "',
    ("llama3.1", "get_weather"): '{"name": "get_weather", "parameters":',
}
FORCED |= {("smollm2+chatml_tools", c): FORCED["qwen2.5", c] for c in ("required", "get_weather")}


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_template_tool_choice_starts_the_call(family, s, choice):
    """tool_choice required / a named function: the prompt is apply_chat_template's, then the start
    of the call as the template writes it; the model's rest of it is read back as the call."""
    fam, tok, hf = family
    messages, reply = CONVERSATIONS["question"], REPLIES["one_call"]
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    p = request(tok, s, {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice})
    want = hf.apply_chat_template(as_template_gets_them(messages), tools=TOOLS, add_generation_prompt=True)
    head = FORCED[fam, choice]
    assert list(p.prompt_ids) == [*ids_of(want),
                                  *hf.encode(head, add_special_tokens=False)]
    text = completion_of(hf, messages, reply)
    # the prompt stops where the tokenizer splits the template's call anyway
    assert text.startswith(head) and hf.encode(text, add_special_tokens=False) == [
        *hf.encode(head, add_special_tokens=False), *hf.encode(text[len(head):], add_special_tokens=False)]
    r = _result_line(p, [Completion(tok.encode(text[len(head):], add_special_tokens=False), "stop")], tok, False)
    [c] = r["tool_calls"]
    assert (r["finish_reason"], c["function"]["name"], json.loads(c["function"]["arguments"])) == (
        "tool_calls", "get_weather", {"city": "Zürich", "unit": "celsius"})


HARMONY_FORCED = {"required": "<|channel|>commentary to=functions",
                  "get_weather": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"}


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_harmony_tool_choice_starts_the_call(tok, enc, s, choice):
    """The prompt is openai-harmony's, then a commentary header to the function(s); the model's
    rest of the message is read as openai-harmony's parser reads the whole of it."""
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    messages = CONVERSATIONS["question"]
    p = harmony_request(tok, s, {"messages": messages, "tools": TOOLS, "tool_choice": tool_choice})
    head = enc.encode(HARMONY_FORCED[choice], allowed_special="all")
    assert list(p.prompt_ids) == [*harmony_reference(enc, messages, TOOLS), *head]
    whole = enc.encode(TOOL_COMPLETIONS["call_only"], allowed_special="all")
    assert whole[: len(head)] == head
    r = _result_line(p, [Completion(whole[len(head):], "stop")], tok, False, HarmonyChat(tok))
    [c] = r["tool_calls"]
    want = harmony_calls(enc.parse_messages_from_completion_tokens(whole, Role.ASSISTANT))
    assert [(c["function"]["name"], c["function"]["arguments"])] == want and r["finish_reason"] == "tool_calls"


def test_a_function_named_like_a_mode_is_still_that_function(family, s):
    fam, tok, hf = family
    tools = [{"type": "function", "function": {"name": "none"}}]
    choice = {"type": "function", "function": {"name": "none"}}
    p = request(tok, s, {"messages": Q, "tools": tools, "tool_choice": choice})
    head = {"qwen2.5": '<tool_call>\n{"name": "none", "arguments":',
            "smollm2+chatml_tools": '<tool_call>\n{"name": "none", "arguments":',
            "llama3.1": '{"name": "none", "parameters":'}[fam]
    want = hf.apply_chat_template(Q, tools=tools, add_generation_prompt=True)
    assert p.tools and list(p.prompt_ids) == [*ids_of(want),
                                              *hf.encode(head, add_special_tokens=False)]


def test_a_chat_template_given_in_the_config_is_checked_in_one_line():
    from runner.text.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match=r"^checkpoint.chat_template=nope.jinja: no such file \(give a Jinja"):
        read_chat_template("nope.jinja")
    with pytest.raises(TokenizerError, match=r"^checkpoint.chat_template=\{% if %\}: the chat template does not parse"):
        read_chat_template("{% if %}")
    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
