"""A request file's wire format: podrun's own lines (podrun.py) or OpenAI Batch lines
(openai_batch.py). The file's first JSON object decides; a line of the other format gets an error
naming both lines, so that one results file has one format. Each line is read, and each result
written, by its format's module; the ids that match results to requests are its format's, and a
file that repeats one is refused whole, before any model loads."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from runner.api import openai_batch, podrun
from runner.api.common import Answer, Line, Parsed
from runner.settings import Settings
from runner.text.chat import ChatFormat, chat_format
from runner.text.structured import Grammars


@dataclasses.dataclass(frozen=True)
class FileFormat:
    openai_batch: bool  # OpenAI Batch lines (else podrun's own)
    first: int  # the line that decided: the file's first JSON object


def file_format(lines: list[Line]) -> FileFormat:
    """The request file's format, from its first JSON object; a RequestFileError naming them and
    their lines where ids repeat (the format's check_ids)."""
    fmt = next(filter(None, map(deciding, lines)), None)
    if fmt is None:
        return FileFormat(False, lines[0].number)
    _module(fmt).check_ids(lines)
    return fmt


def deciding(line: Line) -> FileFormat | None:
    """The format `line` decides when it is the file's first JSON object; None for a line that is
    not one."""
    d, _ = line.decoded
    return None if d is None else FileFormat(any(k in d for k in openai_batch.KEYS), line.number)


def _module(fmt: FileFormat):
    return openai_batch if fmt.openai_batch else podrun


def ids(lines: list[Line], fmt: FileFormat) -> tuple[list[Any], str]:
    """The ids the file's results carry, in order, and their key (id_key)."""
    return [line_id(line, fmt) for line in lines], id_key(fmt)


def id_key(fmt: FileFormat) -> str:
    """The key of a result line's id: "custom_id" in a Batch file's results, else "id"."""
    return _module(fmt).ID_KEY


def line_id(line: Line, fmt: FileFormat) -> Any:
    """The id the result of `line` carries (ids)."""
    return _module(fmt).line_id(line)


def parse_line(index: int, line: Line, fmt: FileFormat, tokenizer, s: Settings, vocab_size: int,
               chat=None, grammars=None) -> Parsed:
    """One line of a file of format `fmt` -> a request, or one carrying the reason it cannot be
    served (`grammars` compiles formats). Never raises."""
    d, _ = line.decoded
    if d is not None and any(k in d for k in openai_batch.KEYS) != fmt.openai_batch:
        kinds = ("podrun's format", "an OpenAI Batch request (custom_id, method, url, body)")
        return Parsed(index, line_id(line, fmt), error=(
            f"line {line.number} is {kinds[not fmt.openai_batch]}, but the file's first request (line "
            f"{fmt.first}) is {kinds[fmt.openai_batch]}: give one format per file"), code="invalid_request",
            line=line.number)
    return _module(fmt).parse_line(index, line, tokenizer, s, vocab_size, chat, grammars)


def request_fields(line: Line, fmt: FileFormat) -> dict | None:
    """The request fields of `line` in podrun's names (common.py), their values unchecked: a
    podrun line's own, a Batch line's body renamed (openai_batch.request_fields); None for a line
    whose result is an error whatever its fields hold."""
    d, _ = line.decoded
    if d is None or any(k in d for k in openai_batch.KEYS) != fmt.openai_batch:
        return None
    if not fmt.openai_batch:
        return d
    try:
        return openai_batch.request_fields(d)[1]
    except ValueError:
        return None


def request_parser(s: Settings, model, tokenizer, fmt: FileFormat
                   ) -> tuple[ChatFormat | None, tuple[int, ...], Callable[[int, Line], Parsed]]:
    """How a job reads its file's lines: (the model's chat format, the ids that end a completion,
    parse(index, line) -> Parsed). runner.tools.plan reads a file through the same."""
    chat = chat_format(model.family, tokenizer, s.generation.reasoning_effort)
    stop_ids = tuple(dict.fromkeys((chat.stop_ids if chat else ()) + s.generation.stop_token_ids))
    grammars = (Grammars(tokenizer, model.vocab_size, chat.format_stop_ids(stop_ids), chat.grammar_start)
                if chat else None)
    return chat, stop_ids, lambda i, line: parse_line(i, line, fmt, tokenizer, s, model.vocab_size,
                                                      chat, grammars)


def writers(fmt: FileFormat, model_name: str
            ) -> tuple[Callable[[Parsed], dict], Callable[[Parsed, Answer], dict]]:
    """The format's writers: (the line of a request that cannot be served, the line of a request p
    and its answer a); a Batch result is `created` when written."""
    if fmt.openai_batch:
        return openai_batch.error_line, lambda p, a: openai_batch.result_line(p, a, model_name, int(time.time()))
    return podrun.error_line, lambda p, a: podrun.result_line(a)
