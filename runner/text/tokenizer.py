"""Tokenizers of podrun checkpoints, and chat templates rendered the way transformers renders them.

A checkpoint folder carries its source's tokenizer files: `tokenizer.json` (a `tokenizers`
serialization; a GGUF source becomes one at conversion, see `tokenizer_json_from_gguf`) or
`tokenizer.model` (sentencepiece), beside `tokenizer_config.json` (special tokens, add_bos_token,
chat_template), `special_tokens_map.json`, `chat_template.jinja` and `generation_config.json`.

References: transformers v5 `TokenizersBackend` (encode/decode, BOS from the post-processor),
`utils/chat_template_utils.py` (the jinja environment of `apply_chat_template`),
`integrations/gguf/gguf_tokenizer_mapping.py` (GGUF vocabularies), and llama.cpp's
`src/llama-vocab.cpp` (the split regexes each `tokenizer.ggml.pre` type stands for).
"""

from __future__ import annotations

import functools
import json
import os
import re
import struct
from collections.abc import Sequence
from datetime import datetime
from typing import ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import sentencepiece as spm
from etils import epath
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Tokenizer as HFTokenizer

from runner.checkpoints.gguf_file import GGUFFile


class TokenizerError(ValueError):
    """A tokenizer file is unreadable, or describes a tokenizer podrun cannot build."""


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# End-of-turn tokens: generation also stops on one when the chat template writes it.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


class Tokenizer:
    """Text <-> ids and the chat template. `load_tokenizer` builds one; subclasses hold the codec."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    chat_template: str | None
    add_bos: bool  # whether encode(text) prepends BOS
    vocab_size: int

    def __init__(self, config: dict, generation_config: dict, vocab_size: int):
        self.vocab_size = vocab_size
        self.chat_templates = _chat_templates(config)  # {"default": ..., "tool_use": ...}
        self.chat_template = self.chat_templates.get("default", next(iter(self.chat_templates.values()),
                                                                    None))
        # {"bos_token": "<s>", ...}: the template's variables, as transformers' special_tokens_map.
        self.special_tokens = {k: s for k in _SPECIAL_NAMES if (s := _token_str(config.get(k)))}
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        eos = [self.token_to_id(self.special_tokens.get("eos_token"))]
        gen_eos = generation_config.get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
        eos += [self.token_to_id(t) for t in _END_OF_TURN if t in (self.chat_template or "")]
        self.eos_token_ids = tuple(dict.fromkeys(i for i in eos if isinstance(i, int)))

    def token_to_id(self, token: str | None) -> int | None:
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def grammar_source(self):
        """What llguidance builds its view of the vocabulary from (runner/text/structured.py): a
        tokenizer.json text, or an object with every id's bytes (`tokens`), `special_token_ids`,
        `bos_token_id`, `eos_token_id` and encoding by call."""
        raise NotImplementedError

    def chat_template_for(self, tools: list[dict] | None) -> str | None:
        """The template apply_chat_template picks: a checkpoint's "tool_use" one when tools are given."""
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_template

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The chat as text, as transformers' apply_chat_template(tokenize=False, tools=tools)
        renders it (messages and tools are passed to the template as given)."""
        template = self.chat_template_for(tools)
        if template is None:
            raise TokenizerError("this checkpoint has no chat template; send a prompt instead of messages")
        try:
            return _compile(template).render(
                messages=[_message(m) for m in messages], tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template failed: {_one_line(e)}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        """apply_chat_template(tokenize=True): the template writes BOS itself where it wants one."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)


class _FastTokenizer(Tokenizer):
    """A `tokenizers` Tokenizer; its post-processor adds BOS/EOS (transformers v5 ignores
    add_bos_token in tokenizer_config.json when a tokenizer.json is present)."""

    def __init__(self, tok: HFTokenizer, config: dict, generation_config: dict):
        self._tok = tok
        super().__init__(config, generation_config, tok.get_vocab_size(with_added_tokens=True))
        self.add_bos = self.bos_token_id is not None and tok.encode("a").ids[:1] == [self.bos_token_id]

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Byte-level BPE: an incomplete UTF-8 sequence decodes to U+FFFD.
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def grammar_source(self) -> str:
        return self._tok.to_str()


class _SentencePieceTokenizer(Tokenizer):
    """sentencepiece, with special tokens matched in the text as transformers' non-legacy
    LlamaTokenizer does: text after a special token gets no dummy-prefix space."""

    def __init__(self, proto: bytes, config: dict, generation_config: dict):
        sp = self._sp = spm.SentencePieceProcessor(model_proto=proto)
        bare = sentencepiece_model_pb2.ModelProto.FromString(proto)
        bare.normalizer_spec.add_dummy_prefix = False
        self._sp_bare = spm.SentencePieceProcessor(model_proto=bare.SerializeToString())
        config = dict(config)
        for name, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
            if i >= 0:
                config.setdefault(name, sp.id_to_piece(i))
        added = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
        self._added = {_token_str(t): i for i, t in added.items()}  # text -> id, matched whole
        self._special = {i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
        self._special |= {i for i, t in added.items() if not isinstance(t, dict) or t.get("special", True)}
        super().__init__(config, generation_config, max([sp.get_piece_size(), *(i + 1 for i in added)]))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if (t := self.special_tokens.get(name)) and (i := self.token_to_id(t)) is not None:
                self._added.setdefault(t, i)
                self._special.add(i)
        self._id_to_added = {i: t for t, i in self._added.items()}
        longest_first = sorted(self._added, key=len, reverse=True)
        self._split = re.compile("(" + ("|".join(map(re.escape, longest_first)) or "(?!)") + ")")
        self.add_bos = bool(config.get("add_bos_token", True)) and self.bos_token_id is not None
        self._eos = self.token_to_id(self.special_tokens.get("eos_token"))
        self._add_eos = bool(config.get("add_eos_token", False)) and self._eos is not None

    def token_to_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if token in self._added:
            return self._added[token]
        i = self._sp.piece_to_id(token)
        return i if i != self._sp.unk_id() or token == self._sp.id_to_piece(i) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        for k, piece in enumerate(self._split.split(text)):  # text, token, text, token, ..., text
            if k % 2:
                ids.append(self._added[piece])
            elif piece:
                ids += (self._sp if k == 0 else self._sp_bare).encode(piece)
        return ids + [self._eos] if add_special_tokens and self._add_eos else ids

    def grammar_source(self):
        """Each piece's bytes: "▁" is a space, <0xNN> byte NN; special pieces their text."""
        sp, tokens = self._sp, []
        for i in range(self.vocab_size):
            if i in self._id_to_added or i >= sp.get_piece_size():
                tokens.append((self._id_to_added.get(i) or "").encode())
            elif sp.is_byte(i):
                tokens.append(bytes([int(sp.id_to_piece(i)[3:5], 16)]))
            else:
                tokens.append(sp.id_to_piece(i).replace("\u2581", " ").encode())
        special = sorted(i for i in self._special | set(self._id_to_added) if i < self.vocab_size)
        # text mid-completion: no dummy-prefix space
        encode = lambda text: self._sp_bare.encode(text.decode("utf-8", "replace")
                                                   if isinstance(text, bytes) else text)
        return _Vocabulary(tokens, special, self.bos_token_id, self._eos, encode)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, run = "", []  # the dummy-prefix space is dropped only at the start of the text
        for i in [*map(int, ids), None]:
            if i is not None and i not in self._special and i not in self._id_to_added:
                run.append(i)
                continue
            out += (self._sp_bare if out else self._sp).decode(run)
            run = []
            if i is not None and not (skip_special_tokens and i in self._special):
                out += self._id_to_added.get(i) or self._sp.id_to_piece(i)
        return out


class _Vocabulary:
    """A sentencepiece vocabulary as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tokens, special, bos, eos, encode):
        self.tokens, self.special_token_ids = tokens, special
        self.bos_token_id, self.eos_token_id, self._encode = bos, eos, encode

    def __call__(self, text) -> list[int]:
        return self._encode(text)


# --- loading --------------------------------------------------------------------------------------


def load_tokenizer(checkpoint_dir: str, chat_template: str = "") -> Tokenizer | None:
    """The checkpoint's tokenizer, or None when it carries no tokenizer.json / tokenizer.model.
    chat_template: a template's text (read_chat_template's) in place of the checkpoint's own."""
    d = epath.Path(checkpoint_dir)
    config = _read_json(d / "tokenizer_config.json")
    for k, v in _read_json(d / "special_tokens_map.json").items():
        config.setdefault(k, v)
    if (d / "chat_template.jinja").exists():  # takes priority over tokenizer_config's, as in transformers
        config["chat_template"] = _read(d / "chat_template.jinja").decode("utf-8", "replace")
    if chat_template:
        config["chat_template"] = chat_template
    generation_config = _read_json(d / "generation_config.json")
    if (path := d / "tokenizer.json").exists():
        try:
            tok = HFTokenizer.from_str(_read(path).decode("utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({_one_line(e)})") from e
        return _FastTokenizer(tok, config, generation_config)
    if (path := d / "tokenizer.model").exists():
        try:
            return _SentencePieceTokenizer(_read(path), config, generation_config)
        except RuntimeError as e:
            raise TokenizerError(f"{path}: not a readable sentencepiece model ({_one_line(e)})") from e
    return None


def read_chat_template(given: str) -> str:
    """checkpoint.chat_template's template, checked to parse: the text itself where it holds
    Jinja, else a file's ("" for none)."""
    if not given:
        return ""
    if "{{" in given or "{%" in given:
        text = given
    else:
        path = epath.Path(os.path.expanduser(given) if "://" not in given else given)
        if not path.exists():
            raise TokenizerError(f"checkpoint.chat_template={given}: no such file (give a Jinja file "
                                 "or the template's text)")
        text = _read(path).decode("utf-8", "replace")
    try:
        _compile(text)
    except TokenizerError as e:
        shown = given if len(given) < 80 else given[:77] + "..."
        raise TokenizerError(f"checkpoint.chat_template={shown}: {e}") from e
    return text


def _read(path: epath.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read it ({_one_line(e)})") from e


def _read_json(path: epath.Path) -> dict:
    if not path.exists():
        return {}
    try:
        d = json.loads(_read(path).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({_one_line(e)})") from e
    if not isinstance(d, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found {type(d).__name__}")
    return d


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _token_str(t) -> str | None:
    """A special token as tokenizer_config.json spells it: "<s>" or {"content": "<s>", ...}."""
    return t.get("content") if isinstance(t, dict) else t if isinstance(t, str) else None


def _chat_templates(config: dict) -> dict[str, str]:
    """{name: template}: one template is "default"; a list names several
    ([{"name": "default", "template": ...}, {"name": "tool_use", ...}])."""
    t = config.get("chat_template")
    if isinstance(t, list):
        return {x["name"]: x["template"] for x in t if isinstance(x, dict)
                and isinstance(x.get("name"), str) and isinstance(x.get("template"), str)}
    return {"default": t} if isinstance(t, str) else {}


# --- chat templates -------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
    renders its body, so that templates using it parse."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Not jinja's own tojson, which escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the chat template does not parse: {_one_line(e)}") from e


def _message(m: dict) -> dict:
    """As apply_chat_template passes it: None values dropped, reasoning under all its names."""
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


# --- GGUF -----------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_PRES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
# tokenizer.ggml.pre -> the regexes llama.cpp splits the text with, one after the other. r"\p{N}"
# alone is built as HF's Digits(individual_digits=True), as SmolLM2's own tokenizer.json has it.
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (r"\p{N}", _GPT2)),
    **dict.fromkeys((*_LLAMA3_PRES, "dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "grok-2"), (_QWEN2,)),
    "qwen35": (_QWEN35,),
    "tekken": (_TEKKEN,),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), (_GPT4O,)),
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging for these (HF ignore_merges).
_IGNORE_MERGES = frozenset((*_LLAMA3_PRES, "tekken"))
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values


def tokenizer_json_from_gguf(gguf_path: str) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) for the tokenizer a GGUF file describes.

    tokenizer.ggml.model "gpt2" is byte-level BPE, split by the regexes of tokenizer.ggml.pre;
    "llama" is sentencepiece BPE with byte fallback, merges rebuilt from the scores as
    transformers' GGUF loader does. Control tokens become special added tokens, user-defined
    ones plain added tokens, both matched whole in the text.
    """
    meta = _gguf_metadata(gguf_path)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre") or "default"
    if not (tokens := meta.get("tokenizer.ggml.tokens")):
        raise TokenizerError(f"{gguf_path}: no tokenizer.ggml.tokens; the GGUF file carries no tokenizer")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    named = {}  # "bos_token" -> (text, id)
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None and 0 <= i < len(tokens):
            named[name] = (tokens[i], i)
    if kind == "gpt2":
        if pre not in _PRE_SPLITS:
            raise TokenizerError(f"{gguf_path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                                 f"podrun knows {sorted(_PRE_SPLITS)}")
        tok = _byte_level_bpe(tokens, types, meta.get("tokenizer.ggml.merges") or [], pre, gguf_path)
    elif kind == "llama":
        tok = _sentencepiece_bpe(tokens, meta, gguf_path)
    else:
        raise TokenizerError(f"{gguf_path}: tokenizer type {kind!r} (tokenizer.ggml.model) is not supported; "
                             "podrun builds 'gpt2' (byte-level BPE) and 'llama' (sentencepiece) tokenizers")
    special = {i for i, t in enumerate(types) if t in (_UNKNOWN, _CONTROL)} | {i for _, i in named.values()}
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in sorted(special)])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False)
                    for i, t in enumerate(types) if t == _USER_DEFINED and i not in special])
    default_bos = kind == "llama" or pre in _LLAMA3_PRES  # what llama.cpp does when the flag is absent
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and "bos_token" in named
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in named
    if add_bos or add_eos:
        bos, eos = named.get("bos_token"), named.get("eos_token")
        single = [bos[0]] * add_bos + ["$A"] + [eos[0]] * add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=[*single, "$B"], special_tokens=[t for t in (bos, eos) if t is not None]
        )
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False,
              **{k: text for k, (text, _) in named.items()}}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), config


def _gguf_metadata(path: str) -> dict:
    try:
        return {k: v for k, v in GGUFFile(path).metadata.items() if k.startswith("tokenizer.")}
    except (OSError, ValueError, IndexError, KeyError, struct.error) as e:
        raise TokenizerError(f"{path}: not a readable GGUF file ({_one_line(e)})") from e


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map: the byte-level BPE alphabet."""
    out = {b: chr(b) for b in (*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                                *range(ord("®"), ord("ÿ") + 1))}
    for n, b in enumerate([b for b in range(256) if b not in out]):
        out[b] = chr(256 + n)
    return out


def _merge_pairs(merges: list[str], path: str) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise TokenizerError(f"{path}: tokenizer.ggml.merges holds an entry that is not 'left right'")
    return pairs


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str,
                    path: str) -> HFTokenizer:
    # GGUF spells BPE tokens in the byte-level alphabet; respell any that are not (added tokens
    # keep their text, hence their id).
    to_alphabet = _byte_to_unicode()
    alphabet = set(to_alphabet.values())
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= alphabet:
            t = "".join(to_alphabet[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    tok = HFTokenizer(models.BPE(vocab, _merge_pairs(merges, path), ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Digits(individual_digits=True) if r == r"\p{N}"
              else pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], meta: dict, path: str) -> HFTokenizer:
    """transformers' (non-legacy) LlamaTokenizer: BPE with byte fallback over "▁"-spelled text."""
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = meta.get("tokenizer.ggml.scores")
    if merges := meta.get("tokenizer.ggml.merges"):
        pairs = _merge_pairs(merges, path)
    elif scores is not None and len(scores) == len(tokens):
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise TokenizerError(f"{path}: a 'llama' tokenizer needs tokenizer.ggml.scores or .merges")
    tok = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    scheme = "first" if prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] * prefix)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Each split of a token into two tokens is a merge, ranked by the token's score (best first;
    then the longer left part), as transformers' generate_merges ranks them."""
    ranked = []
    for token, score in scores.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        ranked += [(score, len(a), len(b), a, b) for a, b in splits]
    ranked.sort(key=lambda m: m[:3], reverse=True)  # stable: equal keys keep the vocabulary's order
    return [(a, b) for *_, a, b in ranked]
