"""The host loop of continuous batching: which waiting request goes into which free row, and when.

    waiting requests --insert (prefill R prompts of one bucket)--> free rows
    live rows --decode (steps_per_dispatch steps)--> tokens; a row whose request ended is free

Requests are taken in their order. A row frees when its request ends: a stop id or max_tokens
(on device too, where the row then emits nothing more), or a stop string (`stop_check`, on the
host; the device row runs on unseen until it is refilled). Before each decode call every free
row is refilled while requests wait: the oldest waiting request and the next ones in its prompt
bucket, as many as the largest insert size that the free rows and those requests fill, so no
prefill pays for padding rows or for a longer bucket than its prompts need. A request of n
samples is prefilled once into as many free rows as it has samples left (its samples run in turns
when fewer rows are free); each sample is a row of its own from then on.

A request under a format (Request.constraint) walks it on the host, a walk per sample: the walk
gives the mask of each next token, which the device applies before sampling. While such a row is
live, each decode call is one step (the next mask needs the token just taken); the other rows
take that step too, unmasked. Stop strings do not apply to a row under a format: the format says
where it ends.

Once no request waits and at most half the rows are live, the live rows are gathered into a
smaller cache (Engine.shrink: half the rows, or a quarter, ... down to Engine.tail_sizes' least),
so the job's last requests run in decode steps of fewer rows.

Every process of a multi-host run runs this loop over the same requests and reads the same
replicated tokens, so all take the same decisions and the devices see the same programs in the
same order: nothing here depends on a clock or on which process it is.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runner.engine.engine import Completion, Engine, Request, TokenLogprobs


@dataclasses.dataclass
class Stats:
    """What a job did on the engine."""

    rows: int = 0  # the engine's batch size
    decode_calls: int = 0
    decode_steps: int = 0  # decode_calls x steps per dispatch
    row_steps: int = 0  # decode steps x the rows each ran with (fewer once the job's tail shrinks)
    prefill_row_steps: int = 0  # the paged engine's row-steps computing a prompt's chunk, no token
    shrinks: int = 0  # times the live rows were gathered into a smaller cache
    inserts: int = 0  # prefill calls
    prompt_slots: int = 0  # rows x bucket over every insert: the prompt tokens computed, padding in
    prompt_tokens: int = 0  # prompt tokens of every sample that entered a row
    prompt_tokens_computed: int = 0  # of those, the ones prefilled (a prompt once for its samples)
    completion_tokens: int = 0
    insert_s: float = 0.0  # wall time in insert calls (prefill; a first call's compilation too)
    decode_s: float = 0.0  # wall time in decode calls
    masked_calls: int = 0  # decode calls of one step, under some row's format
    mask_s: float = 0.0  # host time computing the formats' token masks
    # the paged engine (runner/engine/paged_scheduler.py):
    pages: int = 0  # the pool's pages, every group's
    pages_peak: int = 0  # the most pages that tables held at once
    pages_mean: float = 0.0  # pages held, the mean over calls
    rows_peak: int = 0  # the most rows live (decoding or prefilling) in one call
    rows_mean: float = 0.0  # rows live, the mean over calls
    preemptions: int = 0  # rows whose pages were taken back mid-request, to be recomputed
    programs: int = 0  # distinct device programs called
    compile_wait_s: float = 0.0  # calls' wall time waiting for their programs' compilation

    @property
    def utilisation(self) -> float:
        """The row-steps in which a row worked (took a token, or computed a chunk of its prompt
        in a paged engine's step) over all: 1 when no row ever idles."""
        return ((self.completion_tokens + self.prefill_row_steps) / self.row_steps
                if self.row_steps else 0.0)


@dataclasses.dataclass
class _Live:
    index: int  # the request's index in the job
    sample: int  # which of its samples
    tokens: list[int]
    queued_s: float  # from the start of the job to its insert
    first_s: float  # from the start of the job to its first token
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asks
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    walk: Any = None  # the walk through the request's format (Request.constraint), if it has one
    broken: bool = False  # a token the format refused: it ends as incomplete


class Scheduler:
    """Runs `requests` through `engine`, each row refilled as its request ends."""

    def __init__(self, engine: Engine, requests: Sequence[Request], stop_ids: Sequence[int] = (),
                 stop_check: Callable[[int, list[int]], bool] | None = None):
        self.engine, self.requests = engine, requests
        self.stop_ids, self.stop_check = tuple(stop_ids), stop_check
        self.stats = Stats(rows=engine.batch_size)
        # waiting request indices per prompt bucket, each in request order, and the samples each
        # has yet to start
        self._waiting: dict[int, deque[int]] = {}
        self._unstarted = {i: deque(range(r.n)) for i, r in enumerate(requests)}
        for i, r in enumerate(requests):
            if r.n < 1:
                raise ValueError(f"request {i}: n={r.n}; a request has one sample or more")
            self._waiting.setdefault(engine.bucket_for(len(r.prompt)), deque()).append(i)
        self._ended: dict[int, dict[int, Completion]] = {}  # finished samples of unfinished requests

    def run(self, on_done: Callable[[list[tuple[int, list[Completion]]]], None]) -> Stats:
        """Generates every request; on_done gets the requests that ended in each insert or decode
        call, as they end: (index, its samples' completions in sample order)."""
        engine, t0 = self.engine, time.perf_counter()
        engine.reset()
        free = list(range(engine.batch_size))  # ascending
        live: dict[int, _Live] = {}
        while self._waiting or live:
            ended: list[tuple[int, list[Completion]]] = []
            while free and self._waiting:
                group, samples, shared = self._next_group(len(free))
                targets = []
                for k in samples:
                    targets.append(free[: len(k)])
                    free = free[len(k):]
                queued = time.perf_counter() - t0
                requests = [self.requests[i] for i in group]
                walks = [r.constraint.start() if r.constraint is not None else None
                         for r, rows in zip(requests, targets) for _ in rows]
                masks = self._masks(walks) if any(walks) else None
                got = engine.insert(targets, requests, self.stop_ids, samples, shared, masks=masks)
                now = time.perf_counter() - t0
                self.stats.insert_s += now - queued
                self.stats.inserts += 1
                computed = [len(r.prompt) - engine.shared_tokens(shared) for r in requests]
                self.stats.prompt_slots += len(group) * engine.bucket_for(max(computed))
                self.stats.prompt_tokens_computed += sum(computed)
                at = 0
                for g, (i, rows, k) in enumerate(zip(group, targets, samples)):
                    r = self.requests[i]
                    self.stats.prompt_tokens += len(r.prompt) * len(rows)
                    for row, sample in zip(rows, k):
                        token = int(got.first[at])
                        live[row] = _Live(i, sample, [token], queued, now, walk=walks[at])
                        if walks[at] is not None and r.max_tokens > 0:
                            live[row].broken = not walks[at].take(token)
                        if r.logprobs:
                            live[row].logprobs = [got.logprobs.at(at)]
                        if r.prompt_logprobs:
                            live[row].prompt_logprobs = got.prompt_logprobs[g]
                        if r.max_tokens == 0:  # scored, not generated
                            live[row].tokens, live[row].logprobs = [], [] if r.logprobs else None
                        at += 1
                        self._end_if_done(row, live, free, ended, now)
            if live:
                walks = [live[row].walk if row in live else None for row in range(engine.rows)]
                masks = self._masks(walks) if any(walks) else None
                began = time.perf_counter() - t0
                emitted, scores = engine.decode(
                    self.stop_ids, logprobs=any(self.requests[x.index].logprobs for x in live.values()),
                    masks=masks)
                now = time.perf_counter() - t0
                steps = emitted.shape[1]
                self.stats.decode_s += now - began
                self.stats.decode_calls += 1
                self.stats.masked_calls += masks is not None
                self.stats.decode_steps += steps
                self.stats.row_steps += steps * engine.rows
                for row in sorted(live):
                    x = live[row]
                    tokens, limit = x.tokens, self.requests[x.index].max_tokens
                    for step, t in enumerate(emitted[row]):
                        if t < 0 or len(tokens) >= limit or tokens[-1] in self.stop_ids:
                            break
                        tokens.append(int(t))
                        if x.walk is not None:
                            x.broken = x.broken or not x.walk.take(int(t))
                        if x.logprobs is not None:
                            x.logprobs.append(scores.at((row, step)))
                    self._end_if_done(row, live, free, ended, now)
            if ended:
                self.stats.completion_tokens += sum(len(c.token_ids) for _, cs in ended for c in cs)
                on_done(ended)
            if live and not self._waiting and len(live) <= engine.rows // 2:
                order = sorted(live)
                if engine.shrink(order) < len(free) + len(live):
                    live = {new: live[old] for new, old in enumerate(order)}
                    free = list(range(len(live), engine.rows))
                    self.stats.shrinks += 1
        return self.stats

    def _masks(self, walks: list) -> np.ndarray:
        """The next token's mask [len(walks), mask_words] of each walk (all bits set for None)."""
        t = time.perf_counter()
        masks = np.full((len(walks), self.engine.mask_words), -1, np.int32)
        for k, walk in enumerate(walks):
            if walk is not None:
                walk.mask(masks[k])
        self.stats.mask_s += time.perf_counter() - t
        return masks

    def _next_group(self, free: int) -> tuple[list[int], list[list[int]], int]:
        """(requests, the samples each starts, the prompt blocks they share from the prefix pool):
        the oldest waiting request and the next ones of its bucket that share as many blocks and
        leave as long a rest to compute, the largest insert size that both the free rows and
        those requests fill; or a request with several samples left alone, with as many of them
        as rows are free. A request whose first block others waiting share too, and that the
        pool lacks, goes alone: once it is kept, the others take it from the pool."""
        engine = self.engine
        bucket = min(self._waiting, key=lambda b: self._waiting[b][0])
        queue = self._waiting[bucket]
        oldest = self.requests[queue[0]]
        shared = engine.prefix_match(oldest)
        first = self._unstarted[queue[0]]
        if len(first) > 1:
            group = [queue[0]]
            samples = [[first.popleft() for _ in range(min(free, len(first)))]]
            if not first:
                queue.popleft()
        elif not shared and any(engine.shares_first_block(oldest, self.requests[i])
                                for i in list(queue)[1:]):
            group = [queue.popleft()]
            samples = [[first.popleft()]]
        else:
            key = self._rest_bucket(oldest, shared)
            sizes = engine.insert_sizes
            most = sizes[max(0, bisect.bisect_right(sizes, free) - 1)]
            group = []
            for i in list(queue):  # one-sample requests of the same shared blocks and rest
                if len(group) == most:
                    break
                r = self.requests[i]
                if len(self._unstarted[i]) == 1 and (
                        i == queue[0] or (engine.prefix_match(r) >= shared
                                          and self._rest_bucket(r, shared) == key)):
                    group.append(i)
            group = group[: sizes[max(0, bisect.bisect_right(sizes, len(group)) - 1)]]
            for i in group:
                queue.remove(i)
            samples = [[self._unstarted[i].popleft()] for i in group]
        if not queue:
            del self._waiting[bucket]
        return group, samples, shared

    def _rest_bucket(self, r: Request, shared: int) -> int:
        """The bucket of what r's prompt leaves to compute after `shared` pool blocks."""
        return self.engine.bucket_for(len(r.prompt) - self.engine.shared_tokens(shared))

    def _end_if_done(self, row: int, live: dict[int, _Live], free: list[int],
                     ended: list[tuple[int, list[Completion]]], now: float) -> None:
        """Ends the row's sample when a stop id, its max_tokens or the stop check says so; the row
        is then free. A request ends with its last sample."""
        x = live[row]
        request = self.requests[x.index]
        completion = finished(x, request, self.stop_ids, self.stop_check, now)
        if completion is None:
            return
        del live[row]
        bisect.insort(free, row)
        done = self._ended.setdefault(x.index, {})
        done[x.sample] = completion
        if len(done) == request.n:
            del self._ended[x.index]
            ended.append((x.index, [done[k] for k in range(request.n)]))


def finished(x: _Live, request: Request, stop_ids: tuple[int, ...],
             stop_check: Callable[[int, list[int]], bool] | None, now: float) -> Completion | None:
    """The completion of sample x when a stop id, its max_tokens, a refused token of its format
    or the stop check ends it (`now`: the time since the job began), else None."""
    tokens = x.tokens
    if tokens and tokens[-1] in stop_ids and not x.broken:
        reason = "stop"
    elif tokens and x.walk is None and stop_check is not None and stop_check(x.index, tokens):
        reason = "stop"
    elif len(tokens) >= request.max_tokens or x.broken:
        reason = "length"
    else:
        return None
    return Completion(tokens, reason, ttft_s=x.first_s - x.queued_s, decode_s=now - x.first_s,
                      logprobs=x.logprobs, prompt_logprobs=x.prompt_logprobs,
                      incomplete_format=x.walk is not None and (
                          x.broken or reason == "length" and not x.walk.complete))


def generate(engine: Engine, requests: Sequence[Request], stop_ids: Sequence[int] = (),
             stop_check: Callable[[int, list[int]], bool] | None = None) -> list:
    """Generates for any number of requests, `engine.batch_size` rows at a time, each row refilled
    as its request ends, in the order of `requests`: a Completion per request, or for a request of
    n > 1 samples a list of n. `stop_check(i, tokens)` lets the caller end request i on the host
    (stop strings); stop_ids end a row on device."""
    out: list = [None] * len(requests)

    def done(ended: list[tuple[int, list[Completion]]]) -> None:
        for i, samples in ended:
            out[i] = samples[0] if requests[i].n == 1 else samples

    Scheduler(engine, requests, stop_ids, stop_check).run(done)
    return out

