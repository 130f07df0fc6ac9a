"""Results out: the results file, written exactly once, and a partial file so that no finished work
is lost.

Results are appended to `<output>.partial` as each batch completes (whole lines, flushed: a killed
process loses none; synced to disk at most every SYNC_EVERY_S, so a machine that goes down loses
at most that much work, which a rerun redoes); a rerun with the same input and output skips what
is already there. When every request is done the results are written to `<output>` in input
order, in one atomic rename. A rerun of a finished job finds `<output>` whole and leaves it.

Object stores (gs://) cannot append or rename: there `<output>.partial/` is a prefix holding
`000000.jsonl` (the header line) and one object per finished batch (`000001.jsonl`, ...), each
appearing whole or not at all; `<output>` is written in one upload (atomic as well), then the batch
objects are deleted, the header last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from etils import epath

from runner.errors import RequestFileError
from runner.storage import check_bucket, is_remote

SYNC_EVERY_S = 1.0  # fsync costs up to tens of ms on a busy disk: once per batch would cost more


def error_message(r: dict) -> str | None:
    """A result line's error message, in either format (None for an answer)."""
    e = r.get("error")
    return e["message"] if isinstance(e, dict) else e


def _dumps(row: dict) -> str:
    """One JSON line, UTF-8 as written; with \\u escapes where a string holds lone surrogates
    (an id sent as "\\ud800"), which UTF-8 cannot carry."""
    text = json.dumps(row, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(row)
    return text + "\n"


def input_digest(texts) -> str:
    """The sha256 of a request file's non-blank lines joined by newlines (streamed: `texts` may be
    a generator), which the partial file's header and a part's header record."""
    h = hashlib.sha256()
    for k, text in enumerate(texts):
        h.update(b"\n" if k else b"")
        h.update(text.encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def differences(found: dict, expected: dict, prefix: str = "") -> list[str]:
    """What a header `found` holds that differs from `expected` (nested dicts key by key), as
    "key=found (this run: expected)" phrases; [] where they agree."""
    out = []
    for key in dict.fromkeys([*expected, *found]):
        a, b = found.get(key), expected.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            out.append(f"{prefix}{key}={json.dumps(a)} (this run: {json.dumps(b)})")
    return out


def _check_writable(output: str) -> None:
    """That `output` can be made where it is asked for: the folder above it a folder (or one that
    can be created) that may be written, and `output` itself not a folder. Checked before any
    model loads, so a mistyped path costs nothing."""
    path = os.path.abspath(os.path.expanduser(output))
    if os.path.isdir(path):
        raise RequestFileError(f"io.output={output} is a folder; name a file in it")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RequestFileError(f"io.output={output}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RequestFileError(f"io.output={output}: {parent} is not writable")


def partial_objects(partial: epath.Path) -> list[epath.Path]:
    """An object store's partial file: its objects in order (the header's first)."""
    try:
        return sorted((p for p in partial.glob("*.jsonl") if p.stem.isdigit()), key=lambda p: int(p.stem))
    except OSError as e:
        raise RequestFileError(f"{partial}: cannot list it ({type(e).__name__}: {e})") from e


def _partial_lines(partial: epath.Path, objects: list[epath.Path] | None) -> list[str]:
    """A partial file's lines, the header first ([] when there is none)."""
    try:
        if objects is None:
            if not partial.exists():
                return []
            return [x for x in partial.read_text(encoding="utf-8").split("\n") if x]
        if objects and objects[0].name != "000000.jsonl":
            return ["{}"]  # batches without their header: not ours to reuse
        with ThreadPoolExecutor(16) as pool:  # one request per object: overlap them
            texts = list(pool.map(lambda p: p.read_text(encoding="utf-8"), objects))
        return [line for text in texts for line in text.split("\n") if line]
    except (OSError, UnicodeDecodeError) as e:
        raise RequestFileError(f"{partial}: cannot read it ({type(e).__name__}: {e})") from e


@dataclasses.dataclass
class Partial:
    """What a partial file holds, as Results writes it: its header ({} where a crash cut it short),
    the results by line index, and the start and failure records of its attempts, in order."""

    header: dict
    done: dict[int, dict]
    attempts: list[dict]


def read_partial(partial: epath.Path, objects: list[epath.Path] | None = None) -> Partial | None:
    """The partial file `partial` read (None where there is none); `objects`: its objects in an
    object store (partial_objects), else it is a local file. A line cut short by a crash is left
    out: its result is simply redone."""
    lines = _partial_lines(partial, objects)
    if not lines:
        return None
    try:
        header = json.loads(lines[0])
    except json.JSONDecodeError:
        header = {}
    out = Partial(header if isinstance(header, dict) else {}, {}, [])
    for line in lines[1:]:
        try:
            r = json.loads(line)
            if not isinstance(r, dict):
                continue
            if "_index" not in r and ("_start" in r or "_failed" in r):
                out.attempts.append(r)
                continue
            out.done[r.pop("_index")] = r
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            continue
    return out


class Results:
    """Appends finished results to `<output>.partial`; `write_final` writes `<output>` in input order.

    Every process reads what is already done; only the writer (process 0) writes, after `open`.
    `header`: more for the partial file's header to record beside the input's digest (a part's
    identity: parts.py); a partial file whose header holds other values is refused,
    and each `open` appends a start record, so that the partial file counts its attempts.
    """

    def __init__(self, output: str, input_lines: list, writer: bool = True, header: dict | None = None):
        if not output:
            raise RequestFileError("io.output is empty: pass --config.io.output=<results.jsonl>")
        check_bucket(output, "io.output", RequestFileError)
        self.output = epath.Path(output)
        self.partial = epath.Path(output + ".partial")
        self.remote = is_remote(output)
        if writer and not self.remote:
            _check_writable(output)
        self.digest = input_digest(line.text for line in input_lines)
        self.header = json.loads(json.dumps(header or {}))  # as the partial file holds it
        self.attempts: list[dict] = []  # the partial file's start and failure records, in order
        self.done: dict[int, dict] = {}
        self._lines: dict[int, str] = {}  # this run's results as encoded for the partial file
        self._objects = partial_objects(self.partial) if self.remote else []
        found = read_partial(self.partial, self._objects if self.remote else None)
        if found is not None:
            if differ := differences({k: found.header.get(k) for k in self.header}, self.header):
                raise RequestFileError(f"{self.partial} was written with {'; '.join(differ)}: delete "
                                       "it, or run with the settings it was written with")
            if found.header.get("input_sha256") != self.digest:
                raise RequestFileError(
                    f"{self.partial} belongs to a different input file; delete it or choose another io.output"
                )
            self.done, self.attempts = found.done, found.attempts
        self.writer = writer
        self.failed = ""  # finished(): the first error of an output whose every line is one
        self._f = None
        self._opened = False
        self._synced = -math.inf  # when the partial file was last synced (time.monotonic)

    def finished(self, ids: list[Any], key: str) -> bool:
        """Whether `<output>` already holds this input's results: one line per request, in order,
        each under its request's `key` ("id" or "custom_id"; `ids` the input's). No partial file:
        an interrupted rerun resumes instead. A RequestFileError where `<output>` holds something
        else, which a run would overwrite. When every held line is an error, `failed` is the
        first one's message."""
        held: list | Exception = []
        errors = []  # each held line's error message ("" for an answer)
        try:
            if (self._objects if self.remote else self.partial.exists()) or not self.output.exists():
                return False
            with self.output.open("r", encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        held.append(r.get(key, None))
                        errors.append(error_message(r) or "")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError) as e:
            held = e
        if held == ids:
            self.failed = errors[0] if errors and all(errors) else ""
            return True
        what = (f"{len(held)} results of another input (this one has {len(ids)} requests)"
                if isinstance(held, list) else f"something that is not a results file ({held})")
        raise RequestFileError(f"io.output={self.output} already holds {what}: choose another "
                               "io.output, or pass --config.io.overwrite=True to replace it")

    def open(self) -> None:
        if not self.writer:
            return
        try:
            if self.remote:  # no directories to make; one object per batch, the header first
                fresh = not self._objects
            else:
                self.output.parent.mkdir(parents=True, exist_ok=True)
                fresh = not self.partial.exists()
                self._f = self.partial.open("a", encoding="utf-8")
            self._opened = True
            if fresh:
                self._append(_dumps({"input_sha256": self.digest, **self.header}))
            if self.header:
                self.attempts.append({"_start": {"at": round(time.time(), 3), "host": socket.gethostname()}})
                self._append(_dumps(self.attempts[-1]))
        except OSError as e:
            raise RequestFileError(f"io.output={self.output}: cannot write next to it ({e})") from e

    def _append(self, text: str) -> None:
        if not self._opened:
            return
        if self.remote:
            n = int(self._objects[-1].stem) + 1 if self._objects else 0
            obj = self.partial / f"{n:06d}.jsonl"
            obj.write_text(text, encoding="utf-8")  # one upload: the object exists whole or not at all
            self._objects.append(obj)
            return
        self._f.write(text)
        self._f.flush()
        if hasattr(self._f, "fileno") and time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self._f.fileno())
            self._synced = time.monotonic()

    def add(self, index_and_results: list[tuple[int, dict]]) -> None:
        if index_and_results:  # each result encoded once: its partial line is its final line indexed
            lines = [(i, _dumps(r)) for i, r in index_and_results]
            self._append("".join(f'{{"_index": {i}, {t[1:]}' if t != "{}\n" else f'{{"_index": {i}}}\n'
                                 for i, t in lines))
            self._lines.update(lines)
        self.done.update(index_and_results)

    def failed_attempt(self, error: str) -> None:
        """Records in the partial file (with a `header`) that this attempt ended in `error`."""
        if self.header and self._opened:
            self.attempts.append({"_failed": {"at": round(time.time(), 3), "host": socket.gethostname(),
                                              "error": error[:400]}})
            self._append(_dumps(self.attempts[-1]))

    def write_final(self, total: int, first: dict | None = None) -> None:
        """`<output>` whole, in input order, in place of `<output>.partial` (a RuntimeError where
        one of the `total` requests has no result); `first`: a line before the results (a part's
        header)."""
        if not self._opened:
            return
        self._opened = False  # nothing more is appended
        if self._f is not None:
            self._f.close()
        missing = [i for i in range(total) if i not in self.done]
        if missing:
            raise RuntimeError(f"{len(missing)} requests have no result (first: line {missing[0] + 1})")
        text = "".join(self._lines.get(i) or _dumps(self.done[i]) for i in range(total))
        text = (_dumps(first) if first else "") + text
        if self.remote:  # one upload is atomic; the header goes last, so a crash here loses nothing
            self.output.write_text(text, encoding="utf-8")
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda p: p.unlink(), self._objects[1:]))
            self._objects[0].unlink()
            return
        tmp = epath.Path(str(self.output) + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(self.output)
        self.partial.unlink()
