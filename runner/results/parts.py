"""Parts of a request file: one job answered by many independent runs, and their results merged.

With io.parts=N the request file is cut into N contiguous ranges of lines of about equal estimated
work (`split`); run i answers its range into `<output>.part-<i:05d>-of-<N:05d>.jsonl` through
writer.Results, as a whole run answers the file (its own `.partial`, exactly once across kills).
A part file's first line says what it was written for, its results follow in input order:

    {"podrun_part": {"index", "parts", "lines": [start, end), "input_sha256", "config",
                     "requests", "errors", "prompt_tokens", "completion_tokens", "attempts",
                     "started_at", "finished_at", "wall_s", "host"}}

`answer_part` is a run's part of the job, and its merge of every part once all are done; `merge`
streams the parts, in order and line by line, into `<output>`, checking each result's id against
its input line; `states` reads what each part has done from the parts' files alone.

The estimate of a line's work is its prompt's tokens and the tokens it may generate: prompt ids
counted where given (a Batch completion's too), else the line's characters / CHARS_PER_TOKEN; plus
n x max_tokens as the request parser reads them from the line's fields (common.sizes: the
request's, else generation.max_new_tokens); a line whose result is an error counts 1. It reads no
tokenizer, only the line, so every host and every rerun cuts the file the same way, whatever its
devices.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import fsspec
from etils import epath

from runner import log
from runner.api.common import Line, iter_lines, sizes
from runner.api.formats import FileFormat, deciding, id_key, ids, line_id, request_fields
from runner.errors import RequestFileError
from runner.report import Summary
from runner.results.writer import Results, differences, error_message, input_digest, partial_objects, \
    read_partial
from runner.settings import Settings, SettingsError
from runner.storage import is_remote

CHARS_PER_TOKEN = 4  # English text in a BPE vocabulary: about 4 characters a token
HEADER = "podrun_part"


def answer_part(s: Settings, lines: list[Line], fmt: FileFormat, began: float,
                generate: Callable[[list[Line], Results, Callable[[], dict]], Summary],
                writer: bool) -> Summary:
    """Part io.part of io.parts: its lines answered into its own file by `generate(lines, results,
    header)` (the job's; `header()` the line its final file starts with), or found done there;
    then the merge into io.output where this run (the writing process) finds every part done."""
    if s.part < 0:
        raise SettingsError(f"io.parts={s.parts} splits the input: give --config.io.part=<0 to "
                            f"{s.parts - 1}>, or run it as a Kubernetes Indexed Job (JOB_COMPLETION_INDEX)")
    if not s.overwrite and epath.Path(s.output).exists() and Results(s.output, lines, writer=False).finished(
            *ids(lines, fmt)):
        log.info(f"{s.output} already holds the results of {s.input}'s {len(lines)} requests: nothing to do")
        return Summary(requests=len(lines), already_done=len(lines))
    part = select(lines, fmt, s.part, s.parts, s.generation.max_new_tokens, s.output, s.result_config)
    lines = lines[part.start:part.end]
    what = (f"part {part.index} of {part.parts} (requests {part.start + 1}-{part.end})" if lines
            else f"part {part.index} of {part.parts} (no requests)")
    header = None if s.overwrite else read_header(part.path)
    if header is not None:
        check(part.path, header, part.identity())
        log.info(f"{part.path} already holds {what}: nothing to do (--config.io.overwrite=True "
                 "generates it again)")
        summary = Summary(requests=len(lines), already_done=len(lines))
    elif not lines:  # a part of nothing, where there are more parts than requests
        results = Results(part.path, lines, writer=writer, header={"part": part.identity()})
        results.open()
        results.write_final(0, part.header(results, began))
        summary = Summary()
    else:
        log.info(f"answering {what} into {part.path}")
        results = Results(part.path, lines, writer=writer, header={"part": part.identity()})
        try:
            summary = generate(lines, results, lambda: part.header(results, began))
        except Exception as e:  # the partial file records the failed attempt (status shows it)
            results.failed_attempt(f"{type(e).__name__}: {e}")
            raise
    if writer:
        merge_when_complete(s)
    return summary


def merge_when_complete(s: Settings) -> None:
    """The parts merged into io.output where every one is done (by whichever run finds so: two
    that merge at once write the same file)."""
    if gone := missing(s.output, s.parts):
        log.info(f"{s.parts - len(gone)} of {s.parts} parts done; {s.output} waits for part(s) "
                 f"{indexes(gone)}")
        return
    log.info(f"all {s.parts} parts are done: merging them into {s.output}")
    m = merge(s.input, s.output, s.parts, s.result_config)
    log.info(f"{s.output}: {m.requests} requests ({m.errors} errors), {m.prompt_tokens} prompt + "
             f"{m.completion_tokens} completion tokens, from {s.parts} parts")


def part_path(output: str, index: int, parts: int) -> str:
    """Where part `index` of `parts` writes its results: beside the output, named after it."""
    return f"{output}.part-{index:05d}-of-{parts:05d}.jsonl"


def estimate(line: Line, fmt: FileFormat, max_new_tokens: int) -> int:
    """The work of one request line, in tokens (at least 1): prompt plus n x max_tokens."""
    d = request_fields(line, fmt)
    if d is None:
        return 1  # an error result
    ids = d.get("prompt_token_ids")
    prompt = len(ids) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) \
        else len(line.text) // CHARS_PER_TOKEN
    n, max_tokens = sizes(d, max_new_tokens)
    return max(1, prompt + n * max_tokens)


def split(work: list[int], parts: int) -> list[int]:
    """Bounds b[0] = 0 <= b[1] <= ... <= b[parts] = len(work): part i is work[b[i]:b[i + 1]]. Bound
    k is the line boundary nearest k/parts of the total work (the earlier on a tie), so no part
    is more than the largest line's work away from the mean. Integers only: the same everywhere."""
    prefix = [0, *itertools.accumulate(work)]
    total = prefix[-1]
    bounds = [0]
    for k in range(1, parts):
        j = bisect.bisect_left(prefix, -(-k * total // parts))  # the first prefix >= k/parts of it
        if j > 0 and k * total - parts * prefix[j - 1] <= parts * prefix[j] - k * total:
            j -= 1
        bounds.append(max(bounds[-1], j))
    return bounds + [len(work)]


@dataclasses.dataclass(frozen=True)
class Part:
    """Part `index` of `parts`: lines [start, end) of the input (0-based among its non-blank lines)."""

    index: int
    parts: int
    start: int
    end: int
    input_sha256: str  # the whole input's (results.input_digest)
    config: dict  # Settings.result_config
    output: str

    @property
    def path(self) -> str:
        return part_path(self.output, self.index, self.parts)

    def identity(self) -> dict:
        """What the part was written for: its partial file's header and its part file's record it."""
        return json.loads(json.dumps({"index": self.index, "parts": self.parts, "lines": [self.start, self.end],
                                      "input_sha256": self.input_sha256, "config": self.config}))

    def header(self, results: Results, began: float) -> dict:
        """The part file's first line, once every result is in: what it was written for, what it
        holds, its attempts, when it began (its first attempt) and how long this attempt took."""
        prompt = completion = errors = 0
        for r in results.done.values():
            errors += bool(error_message(r))
            usage = usage_of(r)
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
        starts = [a["_start"]["at"] for a in results.attempts if "_start" in a]
        now = time.time()
        return {HEADER: {**self.identity(), "requests": self.end - self.start, "errors": errors,
                         "prompt_tokens": prompt, "completion_tokens": completion,
                         "attempts": max(1, len(starts)), "started_at": min(starts, default=began),
                         "finished_at": round(now, 3), "wall_s": round(now - began, 3),
                         "host": socket.gethostname()}}


def usage_of(r: dict) -> dict:
    """A result line's usage, in either format ({} for an error)."""
    if isinstance(r.get("response"), dict):  # an OpenAI Batch line: its body's
        r = r["response"].get("body") or {}
    usage = r.get("usage")
    return usage if isinstance(usage, dict) else {}


def select(lines: list[Line], fmt: FileFormat, index: int, parts: int, max_new_tokens: int,
           output: str, config: dict) -> Part:
    """Part `index` of the file `lines` cut into `parts`. Decodes every line once (and drops
    what it decoded)."""
    work = []
    for line in lines:
        work.append(estimate(line, fmt, max_new_tokens))
        line.release()
    bounds = split(work, parts)
    return Part(index, parts, bounds[index], bounds[index + 1], input_digest(x.text for x in lines),
                config, output)


def read_header(path: str) -> dict | None:
    """A part file's header (None where there is no such file); a RequestFileError naming the
    file where its first line is not one."""
    try:
        with fsspec.open(path, "rb", block_size=1 << 16) as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RequestFileError(f"{path}: cannot read it ({type(e).__name__}: {e})") from e
    try:
        header = json.loads(first)[HEADER]
        if isinstance(header, dict):
            return header
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        pass
    raise RequestFileError(f"{path} is not a podrun part file (its first line has no {HEADER!r} header): "
                           "delete it, or choose another io.output")


def check(path: str, header: dict, expected: dict) -> None:
    """A RequestFileError naming part file `path` and what it was written for that differs from
    `expected` (a Part's identity, "lines" left out where not known)."""
    found = {k: header.get(k) for k in expected}
    if found.get("input_sha256") != expected.get("input_sha256"):
        raise RequestFileError(f"{path} was written for another input file (its input_sha256 "
                               f"{str(found.get('input_sha256'))[:12]}..., this one's "
                               f"{str(expected.get('input_sha256'))[:12]}...): delete it, or give the "
                               "io.input it was written for")
    if differ := differences(found, expected):
        raise RequestFileError(f"{path} was written with {'; '.join(differ)}: delete it, or run with "
                               "the settings it was written with")


def missing(output: str, parts: int) -> list[int]:
    """The parts whose files are not there yet (one listing of the output's folder)."""
    there = _listing(output)
    return [i for i in range(parts) if part_path(os.path.basename(output), i, parts) not in there]


def other_counts(output: str, parts: int) -> list[int]:
    """The counts of parts other than `parts` that part files beside `output` were cut into."""
    pattern = re.compile(re.escape(os.path.basename(output)) + r"\.part-\d{5,}-of-(\d{5,})\.jsonl")
    return sorted({int(m[1]) for name in _listing(output) if (m := pattern.fullmatch(name))} - {parts})


def _listing(output: str) -> set[str]:
    folder = epath.Path(output).parent
    try:
        return {p.name for p in folder.iterdir()} if folder.exists() else set()
    except OSError as e:
        raise RequestFileError(f"io.output={output}: cannot list {folder} ({type(e).__name__}: {e})") from e


def indexes(xs: list[int], most: int = 20) -> str:
    """Part indexes for a message: "3, 7, 9" (the first `most`, then how many more)."""
    more = f" and {len(xs) - most} more" if len(xs) > most else ""
    return ", ".join(map(str, xs[:most])) + more


def _scan(input: str) -> tuple[str, int, FileFormat | None]:
    """One pass over the request file: its digest, its line count and its format (None: no line is
    a JSON object), in constant memory."""
    count, fmt = 0, None

    def texts():
        nonlocal count, fmt
        for line in iter_lines(input):
            count += 1
            fmt = fmt or deciding(line)
            yield line.text

    digest = input_digest(texts())
    return digest, count, fmt


@dataclasses.dataclass
class Merged:
    """What the merged file holds, from the parts' headers."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


def merge(input: str, output: str, parts: int, config: dict) -> Merged:
    """Streams the `parts` part files of `output` into `output`, in input order, once each has been
    checked: written for this input and config, its range following the one before, each result's
    id its input line's, as many results as lines. Constant memory; `output` appears whole or not
    at all (a temporary beside it, renamed, or in an object store copied into place). A
    RequestFileError naming the first fault, leaving `output` as it was."""
    if gone := missing(output, parts):
        others = other_counts(output, parts) if len(gone) == parts else []
        hint = f"; the part files there were cut into {' or '.join(map(str, others))}" if others else ""
        raise RequestFileError(f"{len(gone)} of {parts} parts are not done: part(s) {indexes(gone)} (part "
                               f"{gone[0]} writes {part_path(output, gone[0], parts)}){hint}")
    paths = [part_path(output, i, parts) for i in range(parts)]
    headers = [read_header(p) for p in paths]
    digest, total, fmt = _scan(input)
    start, merged = 0, Merged()
    for i, (path, h) in enumerate(zip(paths, headers)):
        check(path, h, {"index": i, "parts": parts, "input_sha256": digest, "config": config})
        lines = h.get("lines")
        if not (isinstance(lines, list) and len(lines) == 2 and lines[0] == start and start <= lines[1] <= total):
            raise RequestFileError(f"{path} holds lines {lines} where part {i} starts at {start}: "
                                   f"the parts were cut differently; delete it and run part {i} again")
        start = lines[1]
        for k in ("requests", "errors", "prompt_tokens", "completion_tokens"):
            setattr(merged, k, getattr(merged, k) + int(h.get(k, 0)))
    if start != total:
        raise RequestFileError(f"the {parts} parts cover {start} of the input's {total} lines: delete "
                               f"{paths[-1]} and run part {parts - 1} again")
    fmt = fmt or FileFormat(False, 1)
    with _replacing(output) as out:
        requests = iter_lines(input)
        for i, (path, h) in enumerate(zip(paths, headers)):
            _copy(path, i, h["lines"], requests, fmt, out)
    return merged


def _copy(path: str, index: int, lines: list[int], requests, fmt: FileFormat, out) -> None:
    """Part `index`'s results into `out`, each checked against the next request line."""
    key = id_key(fmt)

    def fault(what: str) -> RequestFileError:
        return RequestFileError(f"{path} {what}: delete it and run part {index} again")

    with epath.Path(path).open("rb") as f:
        f.readline()  # the header, read before
        for k in range(lines[0], lines[1]):
            raw = f.readline()
            if not raw.endswith(b"\n"):
                raise fault(f"holds {k - lines[0]} results for its {lines[1] - lines[0]} lines (cut short)")
            line = next(requests)
            try:
                held = _result_id(raw, key)
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
                raise fault(f"result {k - lines[0] + 1} is not a JSON object ({e})") from None
            want = line_id(line, fmt)
            # the same JSON value (a NaN id is not equal to itself; 1 is equal to true)
            if type(held) is not type(want) or (held != want and json.dumps(held) != json.dumps(want)):
                raise fault(f"result {k - lines[0] + 1} has {key} {json.dumps(held)[:40]} where input line "
                            f"{line.number} has {json.dumps(want)[:40]}")
            out.write(raw)
            line.release()
        if f.readline().strip():
            raise fault(f"holds more than its {lines[1] - lines[0]} results")


_DECODER = json.JSONDecoder()


def _result_id(raw: bytes, key: str) -> Any:
    """The id result line `raw` carries under `key`, read where podrun writes it, at the line's
    start: {"id": <id>, ...} in podrun's format, {"id": "batch_req_...", "custom_id": <id>, ...}
    in a Batch file's (a result's token ids and text, most of its bytes, are not parsed); a line
    that starts otherwise is parsed whole."""
    text = raw.decode("utf-8")
    if text.startswith('{"id": '):
        value, end = _DECODER.raw_decode(text, 7)
        if key == "id":
            return value
        if text.startswith(', "custom_id": ', end):
            return _DECODER.raw_decode(text, end + 15)[0]
    return json.loads(text).get(key)


class _replacing:
    """A binary file to write `output` through: a temporary beside it that replaces `output` on a
    clean exit (renamed; in an object store copied into place, whole, then deleted), and is
    deleted on an error."""

    def __init__(self, output: str):
        self.output = output
        self.remote = is_remote(output)

    def __enter__(self):
        if not self.remote:
            os.makedirs(os.path.dirname(os.path.abspath(self.output)), exist_ok=True)
        self.tmp = f"{self.output}.merging-{uuid.uuid4().hex[:12]}"  # another merge's is another
        self.f = epath.Path(self.tmp).open("wb")
        return self.f

    def __exit__(self, kind, error, tb) -> None:
        try:
            self.f.close()
            if kind is None:
                if self.remote:
                    fs, _ = fsspec.core.url_to_fs(self.output)
                    fs.copy(self.tmp, self.output)  # server-side: the object appears whole
                else:
                    os.replace(self.tmp, self.output)
        finally:
            if kind is not None or self.remote:
                epath.Path(self.tmp).unlink(missing_ok=True)


@dataclasses.dataclass
class State:
    """What part `index` has done, from its files alone."""

    index: int
    state: str  # done | started (running, or stopped before it ended) | failed | pending
    header: dict  # done: its part file's header; started, failed: its partial file's
    results: int = 0  # results written (done: all of them)
    attempts: int = 0  # starts recorded
    error: str = ""  # failed: the last attempt's error
    updated: float | None = None  # when its partial file last changed (unix time), where known

    @property
    def lines(self) -> tuple[int, int] | None:
        x = self.header.get("lines")
        return (x[0], x[1]) if isinstance(x, list) and len(x) == 2 else None


def states(output: str, parts: int) -> list[State]:
    """Every part's state, from its part file or its partial file, without the input."""
    gone = set(missing(output, parts))
    return [_state(output, i, parts, done=i not in gone) for i in range(parts)]


def _state(output: str, index: int, parts: int, done: bool) -> State:
    if done:
        h = read_header(part_path(output, index, parts))
        return State(index, "done", h, h.get("requests", 0), h.get("attempts", 1))
    partial = epath.Path(part_path(output, index, parts) + ".partial")
    objects = partial_objects(partial) if is_remote(output) else None
    found = read_partial(partial, objects)
    if found is None:
        return State(index, "pending", {})
    header = found.header.get("part") or {}
    last = found.attempts[-1] if found.attempts else {}
    error = (last.get("_failed") or {}).get("error", "")
    starts = sum(1 for r in found.attempts if "_start" in r)
    try:
        updated = (objects[-1] if objects else partial).stat().mtime
    except (OSError, AttributeError, NotImplementedError):
        updated = None
    return State(index, "failed" if error else "started", header, len(found.done), starts, error,
                 updated)
