"""The host loop of continuous batching: which waiting request goes into which free row, and when.

    waiting requests --insert (prefill R prompts of one bucket)--> free rows
    live rows --decode (steps_per_dispatch steps)--> tokens; a row whose request ended is free

Requests are taken in their order. A row frees when its request ends: a stop id or max_tokens
(on device too, where the row then emits nothing more), or a stop string (`stop_check`, on the
host; the device row runs on unseen until it is refilled). Before each decode call every free
row is refilled while requests wait: the oldest waiting request and the next ones in its prompt
bucket, as many as the largest insert size that the free rows and those requests fill, so no
prefill pays for padding rows or for a longer bucket than its prompts need.

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

from runner.engine.engine import Completion, Engine, Request


@dataclasses.dataclass
class Stats:
    """What a job did on the engine."""

    rows: int = 0  # the engine's batch size
    decode_calls: int = 0
    decode_steps: int = 0  # decode_calls x steps per dispatch
    row_steps: int = 0  # decode steps x the rows each ran with (fewer once the job's tail shrinks)
    shrinks: int = 0  # times the live rows were gathered into a smaller cache
    inserts: int = 0  # prefill calls
    prompt_slots: int = 0  # rows x bucket over every insert: the prompt tokens prefilled, padding in
    completion_tokens: int = 0
    insert_s: float = 0.0  # wall time in insert calls (prefill; a first call's compilation too)
    decode_s: float = 0.0  # wall time in decode calls

    @property
    def utilisation(self) -> float:
        """Completion tokens per decode row-step: 1 when no row ever idles."""
        return self.completion_tokens / self.row_steps if self.row_steps else 0.0


@dataclasses.dataclass
class _Live:
    index: int  # the request's index in the job
    tokens: list[int]
    queued_s: float  # from the start of the job to its insert
    first_s: float  # from the start of the job to its first token


class Scheduler:
    """Runs `requests` through `engine`, each row refilled as its request ends."""

    def __init__(self, engine: Engine, requests: Sequence[Request], stop_ids: Sequence[int] = (),
                 stop_check: Callable[[int, list[int]], bool] | None = None):
        self.engine, self.requests = engine, requests
        self.stop_ids, self.stop_check = tuple(stop_ids), stop_check
        self.stats = Stats(rows=engine.batch_size)
        # waiting request indices per prompt bucket, each in request order
        self._waiting: dict[int, deque[int]] = {}
        for i, r in enumerate(requests):
            self._waiting.setdefault(engine.bucket_for(len(r.prompt)), deque()).append(i)

    def run(self, on_done: Callable[[list[tuple[int, Completion]]], None]) -> Stats:
        """Generates every request; on_done gets the (index, completion) pairs that ended in each
        insert or decode call, as they end."""
        engine, t0 = self.engine, time.perf_counter()
        engine.reset()
        free = list(range(engine.batch_size))  # ascending
        live: dict[int, _Live] = {}
        while self._waiting or live:
            ended: list[tuple[int, Completion]] = []
            while free and self._waiting:
                group = self._next_group(len(free))
                rows, free = free[: len(group)], free[len(group):]
                queued = time.perf_counter() - t0
                first = engine.insert(rows, [self.requests[i] for i in group], self.stop_ids)
                now = time.perf_counter() - t0
                self.stats.insert_s += now - queued
                self.stats.inserts += 1
                self.stats.prompt_slots += len(group) * engine.bucket_for(
                    max(len(self.requests[i].prompt) for i in group))
                for row, i, token in zip(rows, group, first):
                    live[row] = _Live(i, [int(token)], queued, now)
                    self._end_if_done(row, live, free, ended, now)
            if live:
                began = time.perf_counter() - t0
                emitted = engine.decode(self.stop_ids)
                now = time.perf_counter() - t0
                self.stats.decode_s += now - began
                self.stats.decode_calls += 1
                self.stats.decode_steps += engine.steps
                self.stats.row_steps += engine.steps * engine.rows
                for row in sorted(live):
                    tokens, limit = live[row].tokens, self.requests[live[row].index].max_tokens
                    for t in emitted[row]:
                        if t < 0 or len(tokens) >= limit or tokens[-1] in self.stop_ids:
                            break
                        tokens.append(int(t))
                    self._end_if_done(row, live, free, ended, now)
            if ended:
                self.stats.completion_tokens += sum(len(c.token_ids) for _, c in ended)
                on_done(ended)
            if live and not self._waiting and len(live) <= engine.rows // 2:
                order = sorted(live)
                if engine.shrink(order) < len(free) + len(live):
                    live = {new: live[old] for new, old in enumerate(order)}
                    free = list(range(len(live), engine.rows))
                    self.stats.shrinks += 1
        return self.stats

    def _next_group(self, free: int) -> list[int]:
        """The oldest waiting request and the next ones of its bucket: the largest insert size
        that both the free rows and those requests fill."""
        bucket = min(self._waiting, key=lambda b: self._waiting[b][0])
        queue = self._waiting[bucket]
        sizes = self.engine.insert_sizes
        n = sizes[max(0, bisect.bisect_right(sizes, min(free, len(queue))) - 1)]
        group = [queue.popleft() for _ in range(min(n, len(queue)))]
        if not queue:
            del self._waiting[bucket]
        return group

    def _end_if_done(self, row: int, live: dict[int, _Live], free: list[int],
                     ended: list[tuple[int, Completion]], now: float) -> None:
        """Ends the row's request when a stop id, its max_tokens or the stop check says so; the
        row is then free."""
        r = live[row]
        tokens = r.tokens
        if tokens[-1] in self.stop_ids:
            reason = "stop"
        elif self.stop_check is not None and self.stop_check(r.index, tokens):
            reason = "stop"
        elif len(tokens) >= self.requests[r.index].max_tokens:
            reason = "length"
        else:
            return
        del live[row]
        bisect.insort(free, row)
        ended.append((r.index, Completion(tokens, reason, ttft_s=r.first_s - r.queued_s,
                                          decode_s=now - r.first_s)))
