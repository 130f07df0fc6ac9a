"""The errors that mean "bad input", reported as one line and a non-zero exit, no traceback
(USER_ERRORS), and what cannot be served: a request (RequestError, a value: its message, the field
it is about and its kind), or a request file as a whole."""

from __future__ import annotations

import json
from typing import Any

from models.weights import WeightError
from runner.checkpoints.source import SourceError
from runner.checkpoints.store import CheckpointError
from runner.settings import SettingsError
from runner.storage import BucketError
from runner.text.tokenizer import TokenizerError
from sharding.mesh import MeshError
from sharding.rules import RulesError


class RequestError(ValueError):
    """Why one request cannot be served: the message, the request field it is about (as the line
    names it; None for the request as a whole) and a code in OpenAI's words for the kind of fault.
    An OpenAI Batch error line carries all three; podrun's own lines the message."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.field, self.code = field, code


class RequestFileError(ValueError):
    """The request file as a whole cannot be used (missing, unreadable, repeated ids, or a stale
    partial file)."""


class AllFailedError(ValueError):
    """Every request of the file got an error result (the results file is written all the same)."""


USER_ERRORS = (AllFailedError, BucketError, CheckpointError, MeshError, RulesError, RequestFileError,
               SettingsError, SourceError, TokenizerError, WeightError)


def quote(v: Any, limit: int = 40) -> str:
    """v as JSON (request values are JSON), cut to `limit` characters: errors quote what was sent
    without echoing megabytes."""
    try:
        text = json.dumps(v, ensure_ascii=False, default=repr)
    except ValueError:  # a circular value
        text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."
