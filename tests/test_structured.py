"""Structured output: completions held to a JSON schema, a regex or a choice list, judged by
jsonschema, re.fullmatch and membership; on a random model (noise unless held), on the real
SmolLM2, and on every kind of tokenizer podrun loads."""

import dataclasses
import functools
import itertools
import json
import os
import re
from datetime import date, datetime, time

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import regex

from models import llama, weights
from models.registry import Model
from runner.checkpoints import convert, store
from runner.engine.sampling import allowed_tokens
from runner.text import harmony, o200k, structured
from runner.text.chat import HarmonyChat
from runner.text.tokenizer import load_tokenizer, tokenizer_json_from_gguf
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import Rules
from tests.test_end_to_end import podrun, read_jsonl, write_jsonl
from tests import test_tokenizer
from tests.test_tokenizer import write_folder

bpe_folder, sp_model = test_tokenizer.bpe_folder, test_tokenizer.sp_model  # their fixtures
CASES = os.path.join(os.path.dirname(__file__), "data", "structured_cases.jsonl")


def cases(kind: str) -> list[dict]:
    with open(CASES, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def request(i: int, case: dict, **kw) -> dict:
    """A request line for a held-out case (sampled at temperature 1, so a random model's
    preferences do not repeat one token)."""
    r = {"id": i, "prompt": f"Answer {i}:", "max_tokens": 160, "temperature": 1.0, "seed": i, **kw}
    if case["kind"] == "json_schema":
        r["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": f"s{i}", "schema": case["schema"], "strict": True}}
    elif case["kind"] == "regex":
        r["guided_regex"] = case["regex"]
    else:
        r["guided_choice"] = case["choices"]
    return r


# RFC 3339's full-date, full-time and date-time, the shapes datetime's parsers are held to below
RFC3339 = {"date": r"\d{4}-\d\d-\d\d", "time": r"\d\d:\d\d:\d\d(\.\d+)?([zZ]|[+-]\d\d:\d\d)"}
RFC3339["date-time"] = RFC3339["date"] + "[tT]" + RFC3339["time"]
PARSERS = {"date": date.fromisoformat, "time": time.fromisoformat, "date-time": datetime.fromisoformat}


def real(value, fmt: str) -> bool:
    """A string format's reference: jsonschema's Draft 2020-12 format checker (its bare
    FormatChecker() reads `time` as Draft 3's), and for date, time and date-time also the RFC
    3339 shape with datetime's calendar and clock (no year 0, no February 29 out of leap years,
    no second 60): jsonschema checks date-time and time only where rfc3339-validator is
    installed, which no requirement pins."""
    if not jsonschema.Draft202012Validator.FORMAT_CHECKER.conforms(value, fmt):
        return False
    if fmt not in PARSERS or not isinstance(value, str):
        return True
    if not re.fullmatch(RFC3339[fmt], value, re.ASCII):
        return False
    try:
        PARSERS[fmt](value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


CHECKER = jsonschema.FormatChecker(())
CHECKER.checkers = {fmt: (lambda v, fmt=fmt: real(v, fmt), ())
                    for fmt in jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers}


def unique_members(pairs: list) -> dict:
    names = [k for k, _ in pairs]
    if len(set(names)) < len(names):
        raise ValueError(f"a member name repeats: {names}")
    return dict(pairs)


def valid(schema: dict, text: str) -> bool:
    """JSON whose objects' member names are unique, valid under the schema (Draft 2020-12) with
    its string formats checked (`real`)."""
    try:
        value = json.loads(text, object_pairs_hook=unique_members)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema, format_checker=CHECKER).is_valid(value)


def holds(case: dict, text: str) -> bool:
    """The independent judge: jsonschema (`valid`), a full match, membership. The match is the
    `regex` package's, Python's re on a current Unicode: a guided_regex's \\d is any decimal
    digit, and this Python's re knows only Unicode 14's (a random model finds the newer ones)."""
    if case["kind"] == "json_schema":
        return valid(case["schema"], text)
    if case["kind"] == "regex":
        return regex.fullmatch(case["regex"], text) is not None
    return text in case["choices"]


@pytest.fixture(scope="module")
def random_checkpoint(smollm2_gguf, tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer (49152 ids): left alone, it emits noise."""
    model = Model("llama", dataclasses.replace(llama.PRESETS["tiny"], vocab_size=49152))
    rules = Rules.make(make_mesh(MeshShape(data=1), jax.devices()[:1]))
    params = weights.init(model.declare(), jax.random.key(7), rules, jnp.float32)
    text, config = tokenizer_json_from_gguf(smollm2_gguf)
    files = {"tokenizer.json": text.encode(), "tokenizer_config.json": json.dumps(config).encode()}
    out = str(tmp_path_factory.mktemp("random-smollm2-vocab") / "ck")
    convert._write(out, store.Metadata(model, {"files": sorted(files)}, source="random"), params, files)
    return out


def answer(checkpoint: str, rows: list[dict], tmp_path, *overrides: str) -> dict:
    """Runs the job through runner.main on one CPU device (the serving path: podrun's CPU
    kernels, the greedy screen); its results by id."""
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    podrun("runner.main", f"--config=configs/cpu.py:{checkpoint}", f"--config.io.input={path}",
           f"--config.io.output={tmp_path / 'out.jsonl'}", "--config.mesh.num_cpu_devices=1",
           "--config.mesh.data=1", "--config.generation.batch_size=8",
           "--config.generation.max_prompt_len=64", "--config.generation.max_new_tokens=160",
           f"--config.compilation_cache.dir={os.path.dirname(checkpoint)}/xla", *overrides)
    return {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}


def check_all(got: dict, picked: list[dict], offset: int = 0) -> int:
    """Every completion holds its format, or ended at max_tokens flagged incomplete; how many
    are complete."""
    complete = 0
    for i, case in enumerate(picked, offset):
        r = got[i]
        assert "error" not in r, r
        if r.get("incomplete_format"):
            assert r["finish_reason"] == "length"
            continue
        assert r["finish_reason"] == "stop", r
        assert holds(case, r["text"]), (case, r["text"])
        complete += 1
    return complete


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "not": {"type": "string"}}}}}, "not"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "at most one"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
    ({"guided_json": {"type": "object", "properties": {"a": {}}, "minProperties": 2}}, "minProperties 2"),
]
PICKED = cases("json_schema")[:10] + cases("regex")[:5] + cases("choice")[:5]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# Schemas where llguidance alone is looser than jsonschema: string formats, keys not fixed,
# objects without additionalProperties, uniqueItems false, minProperties beside listed keys.
DATED = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                          "at": {"type": "string", "format": "date-time", "maxLength": 25},
                                          "t": {"type": "string", "format": "time", "maxLength": 12}},
         "required": ["day", "at", "t"]}
LETTERS = {"type": "object", "patternProperties": {"^[a-e]$": DIGIT}, "additionalProperties": False,
           "minProperties": 3}
PAIRS = {"type": "object", "patternProperties": {"^[a-c]{1,2}$": {"type": "boolean"}},
         "additionalProperties": False, "minProperties": 2, "maxProperties": 5}
DIGITS = {"type": "array", "items": DIGIT, "uniqueItems": False, "minItems": 2, "maxItems": 4}
COUNTED = {"type": "object", "properties": {"a": DIGIT, "b": {"type": "boolean"}, "c": {"type": "null"}},
           "minProperties": 2}
NESTED = {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "boolean"}},
                                                 "required": ["q"]}}, "required": ["p"]}
STRICT = [{"kind": "json_schema", "schema": s} for s in (DATED, LETTERS, PAIRS, DIGITS, COUNTED, NESTED)]
LONG = {"type": "object", "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}


@pytest.fixture(scope="module")
def mixed_job(random_checkpoint, tmp_path_factory) -> dict:
    """One job on the random model: a few held-out formats of each kind, a free request, a
    format that max_tokens cuts, any JSON object, greedy under a choice, and bad formats."""
    rows = [request(i, c) for i, c in enumerate(PICKED)]
    rows += [request(i, c) for i, c in enumerate(STRICT, 100)]
    rows += [{"id": "free", "prompt": "Answer:", "max_tokens": 20, "temperature": 1.0, "seed": 1},
             {"id": "short", "prompt": "x", "max_tokens": 4, "response_format":
              {"type": "json_schema", "json_schema": {"name": "s", "schema": LONG}}},
             {"id": "json", "prompt": "x", "max_tokens": 60, "temperature": 1.0,
              "response_format": {"type": "json_object"}},
             {"id": "choice", "prompt": "x", "max_tokens": 8, "guided_choice": ["yes", "no"]}]
    rows += [{"id": f"bad{k}", "prompt": "x", "max_tokens": 8, **fields} for k, (fields, _) in enumerate(BAD)]
    return answer(random_checkpoint, rows, tmp_path_factory.mktemp("mixed"))


def test_formats_hold_on_a_random_model(mixed_job):
    """Every held-out format holds, and the free request beside them is left alone."""
    assert check_all(mixed_job, PICKED) == len(PICKED)
    free = mixed_job["free"]
    assert free["usage"]["completion_tokens"] == 20  # noise, to its max_tokens
    assert not holds({"kind": "json_schema", "schema": {"type": "object"}}, free["text"])
    assert mixed_job["choice"]["text"] in ("yes", "no") and mixed_job["choice"]["finish_reason"] == "stop"
    r = mixed_job["json"]
    assert r.get("incomplete_format") or isinstance(json.loads(r["text"]), dict)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["json_schema", "regex", "choice"])
def test_a_hundred_formats_hold_on_a_random_model(random_checkpoint, tmp_path, kind):
    picked = cases(kind)
    assert len(picked) == 100
    got = answer(random_checkpoint, [request(i, c) for i, c in enumerate(picked)], tmp_path)
    assert check_all(got, picked) == 100


def test_completions_validate_under_jsonschema_with_formats_and_unique_names(mixed_job):
    """Dates that exist, member names that do not repeat, no keys beyond those listed,
    uniqueItems false and minProperties beside listed keys accepted: every completion holds
    under jsonschema with its format checker (`holds`)."""
    assert check_all(mixed_job, STRICT, 100) == len(STRICT)


@pytest.mark.slow
def test_many_completions_validate_under_jsonschema(random_checkpoint, tmp_path):
    picked = STRICT * 8
    got = answer(random_checkpoint, [request(i, c) for i, c in enumerate(picked)], tmp_path)
    assert check_all(got, picked) == len(picked)


def test_a_format_cut_by_max_tokens_is_flagged_incomplete(mixed_job):
    r = mixed_job["short"]
    assert r["finish_reason"] == "length" and r["incomplete_format"] is True
    assert r["usage"]["completion_tokens"] == 4
    with pytest.raises(ValueError):
        json.loads(r["text"])
    assert all("incomplete_format" not in mixed_job[i] for i in range(len(PICKED)))


def test_bad_formats_get_an_error_naming_the_problem_and_the_job_goes_on(mixed_job):
    for k, (_, named) in enumerate(BAD):
        error = mixed_job[f"bad{k}"]["error"]
        assert named in error and "\n" not in error, error
    assert all("error" not in mixed_job[i] for i in range(len(PICKED)))


def test_openai_and_vllm_fields_become_one_format():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    openai = structured.parse_format({"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    vllm = structured.parse_format({"guided_json": json.dumps(schema)})
    assert (openai.kind, openai.spec) == (vllm.kind, vllm.spec)  # one cache entry for both
    assert json.loads(openai.spec) == schema
    assert structured.parse_format({"response_format": {"type": "text"}}) is None
    assert structured.parse_format({"prompt": "x"}) is None
    assert structured.parse_format({"guided_choice": ["a", "b", "a"]}).spec == '["a", "b"]'


def test_masks_reach_the_logits_bit_for_bit():
    rng = np.random.default_rng(0)
    V = 70
    allowed = rng.random((3, V)) < 0.3
    masks = np.zeros((3, 3), np.uint32)
    for b, t in zip(*np.nonzero(allowed)):
        masks[b, t // 32] |= np.uint32(1 << (t % 32))
    logits = rng.standard_normal((3, V)).astype(np.float32)
    got = np.asarray(allowed_tokens(jnp.asarray(masks.view(np.int32)), jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))


class EvenTokens:
    """A stand-in format, no library: even ids only, never complete."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def start(self):
        return self

    def mask(self, out: np.ndarray) -> None:
        bits = np.zeros(out.size * 32, np.uint8)
        bits[: self.vocab : 2] = 1
        out[:] = np.packbits(bits, bitorder="little").view(np.int32)

    def take(self, token: int) -> bool:
        return token % 2 == 0

    complete = False


@pytest.mark.parametrize("screen", [True, False])
def test_masked_rows_take_only_allowed_tokens_and_leave_their_neighbours_alone(screen):
    """In one batch: rows under a format (greedy and sampled) take only its tokens and end
    flagged incomplete at max_tokens, the greedy one the argmax of transformers' logits over the
    allowed ids; the free rows beside them decode exactly as transformers' greedy search does,
    several steps per call once the masked rows are done. Greedy tokens through the int8 screen
    (the logits made only where the screen's token is not allowed) and from the logits."""
    from models.policy import Policy
    from runner.engine import Engine, Request, Scheduler
    from tests.conftest import rules_for
    from tests.reference import VOCAB, hf_greedy, hf_logits, tiny_hf, to_podrun

    m = tiny_hf("llama", seed=3)
    rules = rules_for("1dev")
    model, params = to_podrun(m, rules)
    engine = Engine(model, params, rules, Policy(greedy_screen=screen), batch_size=4,
                    max_prompt_len=16, max_new_tokens=24, page_size=16, steps_per_dispatch=8)
    assert (engine.greedy_screen is not None) == screen
    even = EvenTokens(VOCAB)
    prompts = [(5, 9, 2), (7, 1, 4, 4, 8), (3,), (11, 12)]
    requests = [Request(prompts[0], 24), Request(prompts[1], 6, constraint=even),
                Request(prompts[2], 24), Request(prompts[3], 10, temperature=1.0, seed=5, constraint=even)]
    done = {}
    stats = Scheduler(engine, requests).run(lambda ended: done.update(ended))
    for i in (0, 2):
        assert done[i][0].token_ids == hf_greedy(m, prompts[i], 24)
        assert not done[i][0].incomplete_format
    for i in (1, 3):
        c = done[i][0]
        assert len(c.token_ids) == requests[i].max_tokens and c.finish_reason == "length"
        assert all(t % 2 == 0 for t in c.token_ids) and c.incomplete_format
    assert any(t % 2 for t in hf_greedy(m, prompts[1], 6))  # left alone, it takes odd ids
    masked = list(prompts[1])
    for _ in range(6):
        logits = hf_logits(m, [masked])[0, -1]
        masked.append(int(np.argmax(np.where(np.arange(VOCAB) % 2 == 0, logits, -np.inf))))
    assert done[1][0].token_ids == masked[len(prompts[1]):]
    # one-step calls under the masks, then calls of several steps once the masked rows are done
    calls = stats.inserts + stats.decode_calls
    assert 0 < stats.masked_calls < calls < stats.decode_steps


# --- every tokenizer: random walks through the formats' masks -----------------------------------


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool(mask.view(np.uint32)[token // 32] >> np.uint32(token % 32) & 1)


def walk(grammars: structured.Grammars, fmt: structured.Format, chat: bool, seed: int,
         limit: int = 300) -> tuple[list[int], bool]:
    """Tokens drawn uniformly from each step's mask until a stop id: (tokens, ended)."""
    rng = np.random.default_rng(seed)
    m = grammars.compile(fmt, chat).start()
    mask = np.zeros((grammars.vocab_size + 31) // 32, np.int32)  # as Layout.mask_words
    tokens = []
    for _ in range(limit):
        m.mask(mask)
        ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        assert len(ids) and ids.max() < grammars.vocab_size
        # a random walk favours long strings: prefer the stop id where it is allowed
        stops = [i for i in grammars.stop_ids if allowed(mask, i)]
        t = int(stops[0] if stops and rng.random() < 0.5 else rng.choice(ids))
        assert m.take(t)
        tokens.append(t)
        if t in grammars.stop_ids:
            assert m.complete
            return tokens, True
    return tokens, False


FORMATS = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "k": {"enum": ["日本", "é", "a b"]}},
        "required": ["name", "n", "k"], "additionalProperties": False}}}},
    {"guided_regex": r"[a-z]{1,4}-\d{2}"},
    {"guided_choice": ["yes", "yes please", "日本"]},
]
JUDGES = [lambda t: jsonschema.validate(json.loads(t), FORMATS[0]["response_format"]["json_schema"]
                                        ["schema"]) is None,
          lambda t: re.fullmatch(r"[a-z]{1,4}-\d{2}", t) is not None,
          lambda t: t in FORMATS[2]["guided_choice"]]


def assert_walks_hold(tok, vocab_size: int, stop_ids, seeds=range(4)):
    """Asserts that every format, walked by seeded random choices among the tokens its masks allow,
    ends on a stop id and decodes to text its judge (jsonschema, regex.fullmatch, membership)
    accepts."""
    grammars = structured.Grammars(tok, vocab_size, stop_ids)
    for fields, judge in zip(FORMATS, JUDGES):
        for seed in seeds:
            tokens, ended = walk(grammars, structured.parse_format(fields), False, seed)
            assert ended, tok.decode(tokens)
            text = tok.decode(tokens[:-1], skip_special_tokens=False)
            assert judge(text), text


def test_smollm2_byte_level_bpe_walks_hold(smollm2_gguf, tmp_path):
    text, config = tokenizer_json_from_gguf(smollm2_gguf)
    tok = load_tokenizer(write_folder(tmp_path, {"tokenizer.json": text, "tokenizer_config.json": config}))
    assert_walks_hold(tok, 49152, tok.eos_token_ids)


def test_gpt2_style_byte_level_bpe_walks_hold(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    assert_walks_hold(tok, tok.vocab_size, tok.eos_token_ids)


def test_sentencepiece_walks_hold(sp_model, tmp_path):
    folder = write_folder(tmp_path, {"tokenizer.model": sp_model, "tokenizer_config.json": {
        "bos_token": "<s>", "eos_token": "</s>"}})
    tok = load_tokenizer(folder)
    assert_walks_hold(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.fixture(scope="module")
def harmony_grammars(tmp_path_factory) -> structured.Grammars:
    folder = write_folder(tmp_path_factory.mktemp("o200k-harmony"),
                          {"tokenizer.json": o200k.o200k_harmony_tokenizer_json(),
                           "tokenizer_config.json": o200k.TOKENIZER_CONFIG})
    tok = load_tokenizer(folder)
    return structured.Grammars(tok, o200k.VOCAB_SIZE, [harmony.RETURN], HarmonyChat.grammar_start)


def test_harmony_answers_in_the_final_channel(harmony_grammars):
    """o200k_harmony: the format holds in the final channel, after an optional analysis, and the
    completion ends on <|return|>; Harmony's own parser (runner.text.harmony) reads it back."""
    grammars, tok = harmony_grammars, harmony_grammars.tokenizer
    for fields, judge in zip(FORMATS, JUDGES):
        for seed in range(3):
            tokens, ended = walk(grammars, structured.parse_format(fields), True, seed, limit=2000)
            if not ended:  # a random analysis may run on; never an answer without the channel
                assert harmony.RETURN not in tokens
                continue
            assert tokens[0] == harmony.CHANNEL and tokens[-1] == harmony.RETURN
            parsed = harmony.parse(tokens, tok)
            assert parsed.complete and not parsed.error, parsed
            assert judge(parsed.text), parsed.text
    # a plain prompt (no chat) takes the format from its first token
    tokens, ended = walk(grammars, structured.parse_format(FORMATS[1]), False, 0)
    assert ended and JUDGES[1](tok.decode(tokens[:-1]))


def test_the_real_smollm2_fills_a_person_schema(smollm2_gguf, tmp_path_factory, tmp_path):
    out = str(tmp_path_factory.mktemp("smollm2-structured") / "ck")
    convert.convert(smollm2_gguf, out)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "minLength": 1, "maxLength": 40}},
        "required": ["name", "age", "city"], "additionalProperties": False}
    rows = [{"id": i, "messages": [{"role": "user", "content": q}], "max_tokens": 60,
             "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
            for i, q in enumerate(["Describe a person: give their name, age and city as JSON.",
                                   "Invent a character for a story. Reply with name, age and city."])]
    got = answer(out, rows, tmp_path)
    for r in got.values():
        assert r["finish_reason"] == "stop" and "incomplete_format" not in r, r
        person = json.loads(r["text"])
        jsonschema.validate(person, schema)
        assert list(person) == ["name", "age", "city"]  # the schema's order
        assert re.search(r"[A-Za-z]{2}", person["name"]) and re.search(r"[A-Za-z]{2}", person["city"])
        assert 1 <= person["age"] <= 110, person


@pytest.mark.slow
def test_gptoss_chats_answer_in_the_final_channel(tmp_path_factory, tmp_path):
    """A tiny random GPT-OSS through runner.main: every chat under a format either answers in
    the final channel, the text holding the format and Harmony's parse clean, or is flagged
    incomplete (a random analysis may run to max_tokens)."""
    ck = tmp_path_factory.mktemp("gptoss") / "ck"
    convert.random_checkpoint("gptoss:tiny-o200k", str(ck))
    picked = cases("json_schema")[:4] + cases("regex")[:4] + cases("choice")[:4]
    rows = [request(i, c, max_tokens=150) for i, c in enumerate(picked)]
    for r in rows:
        r["messages"] = [{"role": "user", "content": r.pop("prompt")}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    podrun("runner.main", "--config=configs/gptoss_tiny_cpu.py", f"--config.checkpoint.path={ck}",
           f"--config.io.input={path}", f"--config.io.output={tmp_path / 'out.jsonl'}",
           "--config.generation.max_new_tokens=150", "--config.compilation_cache.dir=")
    got = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert check_all(got, picked) > 0
    for r in got.values():
        assert r.get("incomplete_format") or "chat_format_error" not in r, r


# --- what jsonschema checks and llguidance alone leaves to chance: walks by hand ----------------


@pytest.fixture(scope="module")
def smollm2_grammars(smollm2_gguf, tmp_path_factory) -> structured.Grammars:
    text, config = tokenizer_json_from_gguf(smollm2_gguf)
    tok = load_tokenizer(write_folder(tmp_path_factory.mktemp("smollm2-tokenizer"),
                                      {"tokenizer.json": text, "tokenizer_config.json": config}))
    return structured.Grammars(tok, 49152, tok.eos_token_ids)


@functools.cache
def token_ids(grammars: structured.Grammars) -> dict[bytes, list[int]]:
    """The ids of each ordinary token's bytes (llguidance's view of the vocabulary)."""
    ll, ids = grammars._lltokenizer(), {}
    for i in range(grammars.vocab_size):
        if not ll.is_special_token(i):
            ids.setdefault(ll.decode_bytes([i]), []).append(i)
    return ids


def accepts(grammars: structured.Grammars, fields: dict, text: str, chat: bool = False,
            before: list[int] = ()) -> bool:
    """Whether the format's walk can spell the text after the tokens before, in some
    tokenization (llguidance allows some only in long tokens, a key's closing quote with its
    colon), each token allowed by its step's mask, and then allows a stop id. A depth-first
    search; a position no tokenization could go on from is not tried again (the walk's state is
    its text's)."""
    grammar = grammars.compile(structured.parse_format(fields), chat)
    ids, data, failed = token_ids(grammars), text.encode(), set()
    longest = max(map(len, ids))
    mask = np.zeros((grammars.vocab_size + 31) // 32, np.int32)

    def spell(tokens: list[int], at: int) -> bool:
        m = grammar.start()
        for t in tokens:
            m.mask(mask)
            assert allowed(mask, t) and m.take(t)
        m.mask(mask)
        if at == len(data):
            return any(allowed(mask, t) for t in grammars.stop_ids)
        steps = [(t, n) for n in range(min(longest, len(data) - at), 0, -1)
                 for t in ids.get(data[at:at + n], ()) if allowed(mask, t)]
        for t, n in steps:
            if at + n not in failed and spell(tokens + [t], at + n):
                return True
        failed.add(at)
        return False

    return spell(list(before), 0)


def json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def assert_walks_valid(grammars, schema: dict, seeds=range(20), limit: int = 300) -> None:
    """Every seeded random walk through the schema's masks ends, and its text is `valid`."""
    for seed in seeds:
        tokens, ended = walk(grammars, structured.parse_format(json_schema(schema)), False, seed, limit)
        text = grammars.tokenizer.decode(tokens[:-1])
        assert ended, text
        assert valid(schema, text), text


DAYS = ["2023-02-28", "2023-02-29", "2024-02-29", "1900-02-29", "2000-02-29", "2100-02-29",
        "0004-02-29", "0000-01-01", "0001-01-01", "2023-04-30", "2023-04-31", "2023-12-31", "2023-13-01"]
TIMES = ["23:59:59Z", "23:59:60Z", "00:00:00.5+23:59", "24:00:00Z", "12:30:00", "12:30:00z"]


@pytest.mark.parametrize("fmt", ["date", "date-time", "time"])
def test_dates_and_times_are_the_real_ones(smollm2_grammars, fmt):
    """A formatted string's walk takes exactly the strings the reference (`real`) accepts:
    February 29 of leap years only, no year 0, no second 60; and a pattern beside the format
    holds too."""
    stamps = [d + "T" + t for d, t in zip(DAYS, itertools.cycle(TIMES[:3]))] + ["2024-02-29t01:02:03z"]
    values = {"date": DAYS, "time": TIMES, "date-time": stamps}[fmt]
    schema = {"type": "string", "format": fmt}
    got = {v: accepts(smollm2_grammars, json_schema(schema), json.dumps(v)) for v in values}
    assert got == {v: real(v, fmt) for v in values}
    assert any(got.values()) and not all(got.values())
    schema["pattern"] = "^20"
    assert {v: accepts(smollm2_grammars, json_schema(schema), json.dumps(v)) for v in values} == {
        v: real(v, fmt) and v.startswith("20") for v in values}


def test_formatted_strings_hold_on_random_walks(smollm2_grammars):
    assert_walks_valid(smollm2_grammars, DATED, range(30))


def test_member_names_are_unique_in_each_object(smollm2_grammars):
    """Where keys are not fixed, a key may not close with a name its object has (escapes read
    as JSON reads them, nested objects with their own names), and the walk does not enter a key
    that could only end so: a `,` is not allowed once every name the pattern allows is taken."""
    letters = {"type": "object", "patternProperties": {"^[a-c]$": DIGIT}, "additionalProperties": False}
    assert accepts(smollm2_grammars, json_schema(letters), '{"a":7,"b":4}')
    assert not accepts(smollm2_grammars, json_schema(letters), '{"a":7,"a":4}')
    assert accepts(smollm2_grammars, json_schema(letters), '{"a":7,"b":4,"c":0}')
    assert not accepts(smollm2_grammars, json_schema(letters), '{"a":7,"b":4,"c":0,')
    assert not accepts(smollm2_grammars, json_schema(letters), '{"a":7,"b":4,"c')  # it could only end "c"
    anything = {"response_format": {"type": "json_object"}}
    assert accepts(smollm2_grammars, anything, '{"a":{"a":1,"b":[{"a":2}]},"b":"a"}')
    assert not accepts(smollm2_grammars, anything, '{"a":{"x":1,"x":2}}')
    assert not accepts(smollm2_grammars, anything, '{"a\\"b":1,"a\\"b":2}')
    assert accepts(smollm2_grammars, anything, '{"a\\"b":1,"a":2,"b":3}')
    assert not accepts(smollm2_grammars, anything, '{"\\n":1,"\\n":2}')
    for schema in (LETTERS, PAIRS, letters):
        assert_walks_valid(smollm2_grammars, schema)
    ended = 0
    for seed in range(10):  # any JSON object: the walks that end within the limit (strings run long)
        tokens, done = walk(smollm2_grammars, structured.parse_format(anything), False, seed, 400)
        if done:
            value = json.loads(smollm2_grammars.tokenizer.decode(tokens[:-1]), object_pairs_hook=unique_members)
            ended += isinstance(value, dict)
    assert ended


def test_harmony_reads_names_in_the_final_message_only(harmony_grammars):
    """A repeated name in the analysis is free text; in the final message it is refused."""
    grammars, tok = harmony_grammars, harmony_grammars.tokenizer
    analysis = [harmony.CHANNEL, *tok.encode("analysis", False), harmony.MESSAGE,
                *tok.encode('{"a":1,"a":2}', False), harmony.END, harmony.START,
                *tok.encode("assistant", False)]
    final = [harmony.CHANNEL, *tok.encode("final", False), harmony.MESSAGE]
    anything = {"response_format": {"type": "json_object"}}
    assert accepts(grammars, anything, '{"a":1,"b":2}', True, analysis + final)
    assert not accepts(grammars, anything, '{"a":1,"a":2}', True, analysis + final)
    assert not accepts(grammars, anything, '{"a":1,"a":2}', True, final)


def test_unique_items_false_is_accepted_and_true_refused_in_one_line(smollm2_grammars):
    assert_walks_valid(smollm2_grammars, DIGITS)
    assert accepts(smollm2_grammars, json_schema(DIGITS), "[1,1]")
    unique = structured.parse_format(json_schema({"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match=r"^response_format\.json_schema\.schema: .*uniqueItems[^\n]*$"):
        smollm2_grammars.compile(unique)


def possible(schema: dict) -> bool:
    """The reference for a closed object's property count: some set of its properties, the
    required ones among them, has a size within its bounds."""
    props, required = schema["properties"], set(schema.get("required", ()))
    return any(required <= set(keys) and schema.get("minProperties", 0) <= len(keys)
               <= schema.get("maxProperties", len(props))
               for n in range(len(props) + 1) for keys in itertools.combinations(props, n))


def test_property_counts_beside_listed_keys(smollm2_grammars):
    """minProperties and maxProperties of an object whose keys are all listed: compiled where
    some object can meet them (its walks then valid), refused in one line naming the field and
    the bound where none can."""
    props = {"a": DIGIT, "b": {"type": "boolean"}, "c": {"type": "null"}}
    bounds = [{}, {"minProperties": 0}, {"minProperties": 1}, {"minProperties": 2},
              {"minProperties": 3}, {"minProperties": 4}, {"maxProperties": 0}, {"maxProperties": 1},
              {"maxProperties": 2}, {"maxProperties": 3}, {"minProperties": 2, "maxProperties": 2},
              {"minProperties": 2, "maxProperties": 1}]
    for required, closed, bound in itertools.product([[], ["a"], ["a", "b"]], [True, False], bounds):
        schema = {"type": "object", "properties": props, "required": required, **bound}
        if closed:
            schema["additionalProperties"] = False
        fields = json_schema(schema)
        if possible(schema):
            assert_walks_valid(smollm2_grammars, schema, range(4))
        else:
            with pytest.raises(ValueError, match=r"^response_format\.json_schema\.schema: "
                                                 r"(min|max)Properties \d[^\n]*$"):
                smollm2_grammars.compile(structured.parse_format(fields))
    nested = {"type": "object", "properties": {
        "x": {"type": "object", "properties": props, "required": ["a"], "maxProperties": 0}}}
    with pytest.raises(ValueError, match=r"guided_json: maxProperties 0 at /properties/x "):
        smollm2_grammars.compile(structured.parse_format({"guided_json": nested}))


CLOSED = {"type": "object", "required": ["a", "p"], "additionalProperties": False, "properties": {
    "a": DIGIT,
    "p": {"type": "object", "properties": {"q": {"type": "boolean"}}, "additionalProperties": False},
    "l": {"type": "array", "items": {"$ref": "#/$defs/item"}}}, "$defs": {
    "item": {"type": "object", "properties": {"n": DIGIT}, "required": ["n"], "additionalProperties": False}}}


def test_objects_with_listed_properties_are_closed(smollm2_grammars):
    """An object schema with properties and no additionalProperties takes no other keys, at
    every depth ($defs, items), under response_format and guided_json alike: the walk takes a
    text exactly where jsonschema finds it valid under the same schema written closed."""
    schema = json.loads(json.dumps(CLOSED))
    for node in (schema, schema["properties"]["p"], schema["$defs"]["item"]):
        del node["additionalProperties"]
    texts = ['{"a":1,"p":{"q":true}}', '{"a":1,"p":{"q":true},"l":[{"n":2}]}', '{"a":1,"p":{"q":true},"z":1}',
             '{"a":1,"p":{"q":true,"z":1}}', '{"a":1,"p":{},"l":[{"n":2,"z":3}]}']
    for fields in (json_schema(schema), {"guided_json": schema}):
        got = {t: accepts(smollm2_grammars, fields, t) for t in texts}
        assert got == {t: valid(CLOSED, t) for t in texts}
        assert any(got.values()) and not all(got.values())
    assert_walks_valid(smollm2_grammars, NESTED)
    assert_walks_valid(smollm2_grammars, COUNTED)


def test_composed_objects_are_closed_to_the_names_their_parts_list(smollm2_grammars):
    """allOf members, a $ref beside properties: the object takes the names all of them list
    and no other; each part alone would refuse the others' names."""
    a, b = {"type": "object", "properties": {"a": DIGIT}}, {"type": "object", "properties": {"b": DIGIT}}
    written_closed = {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "additionalProperties": False}
    texts = ['{"a":1,"b":2}', '{"a":1}', '{"b":2}', '{"a":1,"c":3}', '{"c":3}']
    for schema in ({"allOf": [a, b]}, {"$defs": {"a": a}, "$ref": "#/$defs/a", "properties": {"b": DIGIT}}):
        got = {t: accepts(smollm2_grammars, json_schema(schema), t) for t in texts}
        assert got == {t: valid(written_closed, t) for t in texts}
