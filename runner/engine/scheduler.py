"""The host loop of the engine: admission by free pages, chunked prefill, preemption.

    waiting samples --admitted (pages for the prompt free)--> a row of a group
    a prompt, chunk by chunk, in the same step as every decoding row --> its first token
    decoding rows --decode calls (steps_per_dispatch steps)--> tokens; a row that ends frees its pages

Samples are admitted in request order, or with longest_first by max_tokens, largest first (a
request of n samples is n samples, one after the other), at most one at a time into each group's
free row, and only while no other row of that group is still prefilling: one prompt per group is
chunked at a time, so every later sample of the same prompt (or prompt of the same prefix) finds
the full pages it shares already written and named, and takes them instead of computing them. A
sample is admitted when the pool has pages for its whole prompt and one token, so a row that
enters does not stall at once.

A row takes pages as it grows. When a decoding row needs a page and none is free, the newest row
of its group gives its pages back (preemption) and its sample goes to the front of the waiting
queue with the tokens it has: readmitted, it computes its prompt and those tokens again as one
prompt, and samples on from its count of tokens, so its tokens are those of an uninterrupted run.

Every process of a multi-host run runs this loop over the same requests and reads the same
replicated tokens, so all take the same decisions: nothing here depends on a clock.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from runner.engine.engine import Program, Runner
from runner.engine.pages import PagePool, Table, digests
from runner.engine.sampling import sample_seed
from runner.engine.types import Completion, Request, Sample, Stats


@dataclasses.dataclass(eq=False)  # a row's sample is itself alone: `in` and `index` by identity
class _Seq:
    """A sample in a row: what it computes before it samples (its prompt, then after a
    preemption the tokens it had), its table of pages, and when it was admitted."""

    live: Sample
    input: list[int]
    table: Table
    order: int
    window: Table | None = None  # the windowed layers' pages (a model with windows)

    @property
    def tables(self) -> list[Table]:
        return [self.table] if self.window is None else [self.table, self.window]

    @property
    def prefilling(self) -> bool:
        return self.table.length < len(self.input)


class Scheduler:
    """Runs `requests` through an engine (a Runner), rows refilled as their requests end."""

    def __init__(self, engine: Runner, requests: Sequence[Request], stop_ids: Sequence[int] = (),
                 stop_check: Callable[[int, list[int]], bool] | None = None,
                 longest_first: bool = False):
        """longest_first: admit requests by max_tokens, largest first (request order among
        equals): the job's longest answers do not start last, with every other row idle until
        they end."""
        self.engine, self.requests = engine, requests
        self.layout = L = engine.layout
        self.order = sorted(range(len(requests)), key=lambda i: -requests[i].max_tokens
                            ) if longest_first else range(len(requests))
        self.stop_ids, self.stop_check = tuple(stop_ids), stop_check
        for i, r in enumerate(requests):
            if r.n < 1:
                raise ValueError(f"request {i}: n={r.n}; a request has one sample or more")
            if not 0 < len(r.prompt) <= L.max_prompt_len or r.max_tokens > L.max_new_tokens:
                raise ValueError(f"request {i}: a prompt of {len(r.prompt)} tokens and max_tokens="
                                 f"{r.max_tokens} exceed max_prompt_len={L.max_prompt_len} or "
                                 f"max_new_tokens={L.max_new_tokens}")
        self.pools = [PagePool(L.pages, L.page_size) for _ in range(L.groups)]
        self.window_pools = [PagePool(L.window_pages, L.page_size) if L.window
                             else None for _ in range(L.groups)]
        self.stats = Stats(batch_size=L.batch_size, pages=L.pages * L.groups)
        self._names: dict[int, list[bytes]] = {}  # each request's full prompt pages' digests
        self._ended: dict[int, dict[int, Completion]] = {}
        self._plan: list[tuple[int, int]] = [(0, 0)]  # _piece's costs, from 0 tokens up
        self._prepared = False

    def _digests(self, i: int) -> list[bytes]:
        if i not in self._names:
            self._names[i] = digests(self.requests[i].prompt, self.layout.page_size)
        return self._names[i]

    def _piece(self, n: int) -> int:
        """The chunk bucket of the next step of a row with n prompt tokens left: the first of the
        cheapest way to compute them in chunks, where a chunk of C slots costs C + the backend's
        step_tokens (a step's own cost). So a prompt's end is padded up to a bucket where a step
        costs much (TPU, GPU), and split into buckets it fills where a step costs little (CPU)."""
        step, plan = self.layout.step_tokens, self._plan
        for m in range(len(plan), n + 1):  # plan[m]: (cost, first bucket) for m tokens
            plan.append(min((C + step + plan[max(0, m - C)][0], C) for C in self.layout.chunks))
        return plan[n][1]

    def programs(self) -> list[Program]:
        """The programs this job's calls will likely run, in the order of their first calls: the
        chunks of the prompts of the first rows, a decode call, then the later prompts' chunks
        (prefix sharing and preemption can ask for others, compiled when first called)."""
        L, out = self.layout, []
        decode = [L.program(0, L.steps)] if any(r.max_tokens > 1 for r in self.requests) else []
        for n, i in enumerate(self.order):
            if n == L.batch_size:
                out += decode
            left = len(self.requests[i].prompt)
            while left > 0:
                C = self._piece(left)
                out.append(L.program(C, 1))
                left -= C
        return list(dict.fromkeys(out + decode))

    def prepare(self) -> None:
        """Hands the programs this job will likely run to the engine's compiling thread, once
        (a job does it before its weights restore; run does it otherwise)."""
        if not self._prepared:
            self._prepared = True
            self.engine.prepare(self.programs())

    def run(self, on_done: Callable[[list[tuple[int, list[Completion]]]], None],
            until: Callable[[], str | None] | None = None) -> Stats:
        """Generates every request; on_done gets the requests that ended in each call, as they
        end: (index, its samples' completions in sample order). `until()`, asked before each
        call, ends the job early when it gives a reason: every sample not yet ended ends then
        with the tokens it has, that reason its finish_reason."""
        for ended in self.ended(until):
            on_done(ended)
        return self.stats

    def ended(self, until: Callable[[], str | None] | None = None
              ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """run's calls as an iterator: the requests that ended in each call; self.stats once it
        is spent. Closed early, the job stops after its current call."""
        self.prepare()
        waited = self.engine.compile_wait_s
        try:
            yield from self._run(until)
        finally:
            self.engine.forget_prepared()
            self.stats.compile_wait_s = self.engine.compile_wait_s - waited

    def _run(self, until: Callable[[], str | None] | None):
        engine, L, t0 = self.engine, self.layout, time.perf_counter()
        G, R = L.groups, L.rows_per_group
        waiting: deque[tuple[int, int, Sample | None]] = deque(
            (i, k, None) for i in self.order for k in range(self.requests[i].n))
        rows: list[list[_Seq | None]] = [[None] * R for _ in range(G)]
        admitted = 0
        calls = pages_held = rows_live = 0
        while waiting or any(s for group in rows for s in group):
            now = time.perf_counter() - t0
            reason = until() if until is not None else None
            if reason:
                yield self._end_all(rows, waiting, reason, now)
                break
            # admission: one sample a group, into a free row, while none of the group prefills
            for g in sorted(range(G), key=lambda g: -self.pools[g].available):
                if not waiting or any(s and s.prefilling for s in rows[g]) or None not in rows[g]:
                    continue
                seq = self._admit(waiting[0], g, admitted, now)
                if seq is None:
                    continue
                waiting.popleft()
                rows[g][rows[g].index(None)] = seq
                admitted += 1
            C = max((self._piece(len(s.input) - s.table.length)
                     for group in rows for s in group if s and s.prefilling), default=0)
            steps = 1 if C else L.steps
            if any(s and s.live.walk is not None for group in rows for s in group):
                steps = 1  # the next token's mask needs the one just taken
            for g in range(G):
                self._grow(rows[g], waiting, C, steps)
            live = [s for group in rows for s in group if s]
            if not live:  # everything admitted was preempted back: admit again
                continue
            step, sampling = self._step(rows, C)
            step.refill[:] = bool(waiting)
            walks = [s.live.walk if s and i in sampling else None
                     for i, s in enumerate(x for group in rows for x in group)]
            masks = None
            if any(w is not None for w in walks):
                m = time.perf_counter()
                masks = np.full((L.batch_size, L.mask_words), -1, np.int32)
                for b, w in enumerate(walks):
                    if w is not None:
                        w.mask(masks[b])
                self.stats.mask_s += time.perf_counter() - m
            logprobs = any(self.requests[s.live.index].logprobs for s in live)
            scored = any(s.prefilling and s.live.prompt_logprobs is not None for s in live)
            began = time.perf_counter() - t0
            emitted, scores, prompt_scores = engine.call(step, self.stop_ids, steps, logprobs,
                                                         masks, scored)
            now = time.perf_counter() - t0
            calls += 1
            held = sum(p.in_use for p in self.pools)
            pages_held += held
            rows_live += len(live)
            st = self.stats
            st.pages_peak, st.rows_peak = max(st.pages_peak, held), max(st.rows_peak, len(live))
            if C:
                st.inserts += 1
                st.insert_s += now - began
                st.prompt_slots += C * G
            else:
                st.decode_calls += 1
                st.decode_s += now - began
            st.masked_calls += masks is not None
            ran = int(np.max(np.nonzero((emitted >= 0).any(axis=0))[0], initial=0)) + 1  # an early end
            st.decode_steps += ran
            st.row_steps += ran * L.batch_size
            st.prefill_row_steps += sum(1 for g, group in enumerate(rows) for r, s in enumerate(group)
                                        if s and s.prefilling and g * R + r not in sampling)
            ended: list[tuple[int, list[Completion]]] = []
            for g in range(G):
                for r in range(R):
                    if rows[g][r] is not None:
                        self._advance(rows[g], g, r, emitted, scores, prompt_scores, C,
                                      ended, now)
            if ended:
                st.completion_tokens += sum(len(c.token_ids) for _, cs in ended for c in cs)
                yield ended
        self.stats.programs = len(engine.programs)
        self.stats.pages_mean = pages_held / calls if calls else 0.0
        self.stats.rows_mean = rows_live / calls if calls else 0.0

    def _end_all(self, rows: list[list[_Seq | None]], waiting: deque, reason: str, now: float
                 ) -> list[tuple[int, list[Completion]]]:
        """Every sample not yet ended, ended with the tokens it has (none, for one never
        admitted) and finish_reason `reason`; their rows and pages freed."""
        samples = [s.live for group in rows for s in group if s] + [
            x or self._new_sample(i, k, now, now) for i, k, x in waiting]
        for group in rows:
            for r, s in enumerate(group):
                if s is not None:
                    for table in s.tables:
                        table.release()
                    group[r] = None
        waiting.clear()
        ended = []
        for x in sorted(samples, key=lambda x: (x.index, x.sample)):
            self._end(x, Completion(
                x.tokens, reason, ttft_s=max(0.0, x.first_s - x.queued_s) if x.tokens else 0.0,
                decode_s=now - x.first_s if x.tokens else 0.0, logprobs=x.logprobs,
                prompt_logprobs=x.prompt_logprobs,
                incomplete_format=x.walk is not None and not x.walk.complete), ended)
        self.stats.completion_tokens += sum(len(c.token_ids) for _, cs in ended for c in cs)
        return ended

    def _end(self, x: Sample, completion: Completion, ended: list) -> None:
        """Keeps a sample's completion; once every sample of its request has one, the request
        goes into `ended` with them, in sample order."""
        done, n = self._ended.setdefault(x.index, {}), self.requests[x.index].n
        done[x.sample] = completion
        if len(done) == n:
            del self._ended[x.index]
            ended.append((x.index, [done[k] for k in range(n)]))

    def _new_sample(self, i: int, k: int, queued_s: float, first_s: float, walk=None) -> Sample:
        """Sample k of request i before its first token, with room for the log-probabilities
        it asks for."""
        r = self.requests[i]
        return Sample(i, k, [], queued_s, first_s, walk=walk, logprobs=[] if r.logprobs else None,
                      prompt_logprobs=[None] * (len(r.prompt) - 1) if r.prompt_logprobs else None)

    def _admit(self, entry: tuple[int, int, Sample | None], g: int, order: int,
               now: float) -> _Seq | None:
        """Sample `entry` into group g, with the prompt pages the pool already holds, when the
        pool has pages for the rest of its prompt and one token; else None (nothing taken)."""
        i, k, prior = entry
        r, pool = self.requests[i], self.pools[g]
        x = prior or self._new_sample(i, k, now, 0.0, r.constraint.start() if r.constraint else None)
        if prior is None:
            self.stats.prompt_tokens += len(r.prompt)
        tokens = list(r.prompt) + x.tokens
        # never the last token (computed for the next one), nor one whose log-probability is asked
        scored = r.prompt_logprobs_from if r.prompt_logprobs else len(tokens)
        names = self._digests(i)[: (min(len(tokens), scored) - 1) // pool.page_size]
        found, skip = self._shareable(names, g)
        window = self.window_pools[g]
        need = Table(pool).pages_for(len(tokens) + 1)
        if need - found > pool.available or (
                window is not None and self.layout.window_pages // self.layout.rows_per_group
                > window.available):
            return None
        table = Table(pool, pool.match(names[:found]))
        seq = _Seq(x, tokens, table, order)
        if window is not None:
            seq.window = Table(window, window.match(names[skip:found]), skipped=skip)
        return seq

    def _shareable(self, names: list[bytes], g: int) -> tuple[int, int]:
        """(pages of a prompt, by their names, that a sample admitted into group g takes from the
        pool rather than computes; of those, the first that the windowed layers need): the most
        that the full layers' pool holds, and of those the windowed layers' pool holds the ones
        the first computed token's window reaches."""
        pool, window, S = self.pools[g], self.window_pools[g], self.layout.page_size
        found = pool.matchable(names)
        skip = lambda n: max(0, n * S - self.layout.window + 1) // S
        while window is not None and found and not window.holds_all(names[skip(found):found]):
            found -= 1
        return found, skip(found) if window is not None else 0

    def _grow(self, group: list[_Seq | None], waiting: deque, C: int, steps: int) -> None:
        """Pages for what each row of the group computes in the next call (a decoding row's
        steps, a prefilling row's chunk), the newest rows preempted, oldest first served, where
        the pool runs short."""
        for s in sorted((s for s in group if s), key=lambda s: s.order):
            if s not in group:
                continue  # preempted for an older row
            if s.prefilling:
                need = s.table.length + min(C, len(s.input) - s.table.length)
            else:
                left = self.requests[s.live.index].max_tokens - len(s.live.tokens)
                need = s.table.length + max(1, min(steps, left))
            if s.window is not None:  # what no query of this call or later can see
                s.window.release_before(s.table.length - self.layout.window + 1)
            while not all(table.grow(need) for table in s.tables):
                newest = max((x for x in group if x), key=lambda x: x.order)
                self._preempt(group, newest, waiting)
                if newest is s:
                    break

    def _preempt(self, group: list[_Seq | None], s: _Seq, waiting: deque) -> None:
        for table in s.tables:
            table.release()
        group[group.index(s)] = None
        waiting.appendleft((s.live.index, s.live.sample, s.live))
        self.stats.preemptions += 1

    def _step(self, rows: list[list[_Seq | None]], C: int):
        """The call's host arrays, and the rows (by index) that sample in it."""
        R = self.layout.rows_per_group
        b = self.layout.empty_step(C)
        sampling = set()
        for g, group in enumerate(rows):
            for r, s in enumerate(group):
                if s is None:
                    continue
                row, request, table = g * R + r, self.requests[s.live.index], s.table
                b.tables[g, r, : len(table.pages)] = table.pages
                if s.window is not None:  # a hole reads page 0, which the window masks
                    b.window_tables[g, r, : len(s.window.pages)] = np.maximum(s.window.pages, 0)
                b.count[row], b.max_tokens[row] = len(s.live.tokens), request.max_tokens
                b.seed[row] = sample_seed(request.seed, s.live.sample)
                b.temperature[row], b.top_k[row] = request.temperature, request.top_k
                b.top_p[row] = request.top_p
                if not s.prefilling:
                    b.tokens[g, r], b.positions[g, r] = s.live.tokens[-1], table.length
                    b.live[row] = True
                    sampling.add(row)
                    continue
                n = min(C, len(s.input) - table.length)
                b.tokens[g, R: R + n] = s.input[table.length: table.length + n]
                after = s.input[table.length + 1: table.length + n + 1]
                b.targets[g, R: R + len(after)] = after
                b.positions[g, R: R + n] = np.arange(table.length, table.length + n)
                b.rows[g, R:] = r
                if table.length + n == len(s.input) and request.max_tokens > 0:  # sample after it
                    b.sample_at[g, r] = R + n - 1
                    b.live[row] = True
                    sampling.add(row)
        return b, sampling

    def _advance(self, group: list[_Seq | None], g: int, r: int, emitted: np.ndarray, scores,
                 prompt_scores, C: int, ended: list, now: float) -> None:
        """Row r of group g after a call: its chunk (and its prompt tokens' log-probabilities) or
        its tokens taken in, and the row freed when its sample ends."""
        s, row = group[r], g * self.layout.rows_per_group + r
        x, request = s.live, self.requests[s.live.index]
        decoding = not s.prefilling  # each token it takes follows one it fed (and wrote)
        if not decoding:
            n = min(C, len(s.input) - s.table.length)
            if x.prompt_logprobs is not None:  # position p's is prompt token p + 1's
                for i, p in enumerate(range(s.table.length, min(s.table.length + n, len(x.prompt_logprobs)))):
                    x.prompt_logprobs[p] = prompt_scores.at((g, i))
            for table in s.tables:
                table.length += n
                table.name_full_pages(self._digests(x.index))
            self.stats.prompt_tokens_computed += n
            if s.prefilling:
                return
            if not x.tokens:
                x.first_s = now
        for step, t in enumerate(emitted[row]):
            if t < 0 or len(x.tokens) >= request.max_tokens or (x.tokens and x.tokens[-1] in self.stop_ids):
                break
            for table in s.tables:
                table.length += decoding
            x.tokens.append(int(t))
            if x.walk is not None:
                x.broken = x.broken or not x.walk.take(int(t))
            if x.logprobs is not None:
                x.logprobs.append(scores.at((row, step)))
        completion = x.finished(request, self.stop_ids, self.stop_check, now)
        if completion is None:
            return
        for table in s.tables:
            table.release()
        group[r] = None
        self._end(x, completion, ended)


def generate(engine: Runner, requests: Sequence[Request], stop_ids: Sequence[int] = (),
             stop_check: Callable[[int, list[int]], bool] | None = None,
             longest_first: bool = False) -> list:
    """Every request through `engine`, in the order of `requests`: a Completion per request, or
    for a request of n > 1 samples a list of n. stop_ids end a sample on the device;
    `stop_check(i, tokens)` lets the caller end request i's on the host (stop strings)."""
    out: list = [None] * len(requests)

    def done(ended: list[tuple[int, list[Completion]]]) -> None:
        for i, samples in ended:
            out[i] = samples[0] if requests[i].n == 1 else samples

    Scheduler(engine, requests, stop_ids, stop_check, longest_first).run(done)
    return out
