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

import hashlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
from etils import epath

from runner.api.errors import RequestFileError

SYNC_EVERY_S = 1.0  # fsync costs up to tens of ms on a busy disk: once per batch would cost more


def is_remote(path: str) -> bool:
    """An object store (gs://, ...): no directories, no append, no rename."""
    return "://" in path


def check_bucket(path: str, what: str, error: type[Exception] = RequestFileError) -> None:
    """A missing bucket fails here, in one line, rather than being created (as gcsfs's mkdir would)."""
    if not is_remote(path):
        return
    scheme, rest = path.split("://", 1)
    name = rest.split("/", 1)[0]
    bucket = f"{scheme}://{name}"
    try:
        if scheme == "gs":  # listing needs object access only (objectViewer), not buckets.get
            fsspec.filesystem("gs").call("GET", "b/{}/o", name, maxResults=1, json_out=True)
        elif not epath.Path(bucket).exists():
            raise FileNotFoundError(bucket)
    except FileNotFoundError:
        raise error(f"{what}={path}: bucket {bucket} does not exist") from None
    except Exception as e:  # auth or network: gcsfs raises several kinds
        raise error(f"{what}={path}: cannot reach {bucket} ({type(e).__name__}: {e})") from e


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


class Results:
    """Appends finished results to `<output>.partial`; `write_final` writes `<output>` in input order.

    Every process reads what is already done; only the writer (process 0) writes, after `open`.
    """

    def __init__(self, output: str, input_lines: list, writer: bool = True):
        if not output:
            raise RequestFileError("io.output is empty: pass --config.io.output=<results.jsonl>")
        check_bucket(output, "io.output")
        self.output = epath.Path(output)
        self.partial = epath.Path(output + ".partial")
        self.remote = is_remote(output)
        if writer and not self.remote:
            _check_writable(output)
        text = "\n".join(line.text for line in input_lines)
        self.digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()
        self.done: dict[int, dict] = {}
        self._lines: dict[int, str] = {}  # this run's results as encoded for the partial file
        self._objects = self._partial_objects() if self.remote else []
        lines = self._read_partial()
        if lines:
            try:
                header = json.loads(lines[0])
            except json.JSONDecodeError:  # a header cut short by a crash
                header = {}
            if header.get("input_sha256") != self.digest:
                raise RequestFileError(
                    f"{self.partial} belongs to a different input file; delete it or choose another io.output"
                )
            for line in lines[1:]:
                try:  # a line cut short by a crash is simply redone
                    r = json.loads(line)
                    self.done[r.pop("_index")] = r
                except (json.JSONDecodeError, KeyError):
                    continue
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

    def _partial_objects(self) -> list[epath.Path]:
        try:
            return sorted((p for p in self.partial.glob("*.jsonl") if p.stem.isdigit()),
                          key=lambda p: int(p.stem))
        except OSError as e:
            raise RequestFileError(f"{self.partial}: cannot list it ({type(e).__name__}: {e})") from e

    def _read_partial(self) -> list[str]:
        """The partial results as lines, the header first ([] when there are none)."""
        try:
            if not self.remote:
                if not self.partial.exists():
                    return []
                return [x for x in self.partial.read_text(encoding="utf-8").split("\n") if x]
            if self._objects and self._objects[0].name != "000000.jsonl":
                return ["{}"]  # batches without their header: not ours to reuse
            with ThreadPoolExecutor(16) as pool:  # one request per object: overlap them
                texts = list(pool.map(lambda p: p.read_text(encoding="utf-8"), self._objects))
            return [line for text in texts for line in text.split("\n") if line]
        except (OSError, UnicodeDecodeError) as e:
            raise RequestFileError(f"{self.partial}: cannot read it ({type(e).__name__}: {e})") from e

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
                self._append(_dumps({"input_sha256": self.digest}))
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

    def write_final(self, total: int) -> None:
        """`<output>` whole, in input order, in place of `<output>.partial` (a RuntimeError where
        one of the `total` requests has no result)."""
        if not self._opened:
            return
        if self._f is not None:
            self._f.close()
        missing = [i for i in range(total) if i not in self.done]
        if missing:
            raise RuntimeError(f"{len(missing)} requests have no result (first: line {missing[0] + 1})")
        text = "".join(self._lines.get(i) or _dumps(self.done[i]) for i in range(total))
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
