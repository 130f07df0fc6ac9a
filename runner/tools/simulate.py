"""A job run through the real host scheduler with no model: runner.tools.plan's simulation.

The Scheduler (runner/engine/scheduler.py) drives a stand-in for the Engine (both Runners) whose
calls compute nothing. A call returns the tokens the completion-length assumption dictates (a sample
of L tokens takes L - 1 tokens that stop nothing, then a stop id) and advances a simulated clock
by the program's time per call (a Costs: measured on the devices present, or predicted). Every
admission, chunk, page, preemption, early end of a decode call and program choice is the
scheduler's own code, and the stand-in emulates the device side's control flow exactly (the
decode loop's end once no row is live, or once a row of a group with a waiting sample stops).

A row's request is known from its seed: each simulated request's seed is its index (seeds change
no decision of the scheduler), so the seed a row samples with names (request, sample).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import time
from collections.abc import Sequence

import numpy as np
from scipy.special import stdtrit  # Student's t quantile (scipy.stats takes a second to import)
from etils import epath

from runner.engine import Layout, Request, Scheduler, Stats
from runner.engine.engine import Program, Step, goes_on
from runner.engine.sampling import sample_seed

STOP, GO = 0, 1  # the stand-in's stop id and a token that stops nothing


class Costs:
    """Seconds per device call and per compilation of a program (measured or predicted)."""

    def call(self, p: Program, contexts: list[np.ndarray], chunk_at: int) -> float:
        """A call of program p whose steps ran over rows holding `contexts` (one array per step
        run: each live decoding row's positions attended) and, for a mixed call, a chunk of
        p.chunk tokens starting at position chunk_at."""
        raise NotImplementedError

    def compile(self, p: Program) -> float:
        return 0.0

    def describe(self) -> list[str]:
        return []


@dataclasses.dataclass
class Outcome:
    """What a simulated job did and how long its generation would take."""

    stats: Stats
    generate_s: float  # from the scheduler's start to its last call's end
    device_s: float  # the calls' time (Costs.call)
    host_s: float  # the scheduler's own host work between calls, measured as it ran here
    compile_wait_s: float  # calls waiting for their programs' compilation (modelled)
    first_result_s: float  # when the first request ended
    completion_tokens: int
    calls: list[str]  # the program of each call, in order
    per_program: dict[str, tuple[int, float]]  # name -> (calls, seconds)


class _Nothing:
    """Log-probabilities the stand-in does not compute (a call's scores: None each)."""

    def at(self, _) -> None:
        return None


class StandIn:
    """A Runner (runner/engine/engine.py) of an engine's layout whose calls run no model."""

    def __init__(self, layout: Layout, requests: Sequence[Request], lengths: Sequence[Sequence[int]],
                 costs: Costs, head: float = 0.0):
        self.layout, self._costs, self._lengths = layout, costs, lengths
        self._who: dict[int, tuple[int, int]] = {}
        for i, r in enumerate(requests):
            for k in range(r.n):
                seed = sample_seed(r.seed, k)
                if self._who.setdefault(seed, (i, k)) != (i, k):
                    raise ValueError(f"requests {self._who[seed]} and {(i, k)} sample with one seed")
        self.programs: set[str] = set()
        self.compile_wait_s = 0.0
        self.clock = 0.0  # simulated seconds since the scheduler started
        self.device_s = 0.0
        self.calls: list[str] = []
        self.per_program: dict[str, list[float]] = {}
        self._ready: dict[Program, float] = {}  # when a prepared program's compilation ends
        self._compiled_from = -head  # when the compiling thread starts (before the scheduler)
        self._host_from = None  # perf_counter at the end of the last call

    def prepare(self, programs: Sequence[Program]) -> None:
        """As Engine.prepare: compiled one after another on one thread, from when the
        job's first prepare is (`head` seconds before the scheduler starts: while the weights
        load), or now."""
        t = self._compiled_from if not self._ready else max(self.clock, *self._ready.values())
        for p in programs:
            if p not in self._ready:
                t += self._costs.compile(p)
                self._ready[p] = t
        self._host_from = time.perf_counter()

    def forget_prepared(self) -> None:
        pass

    def call(self, step: Step, stop_ids: Sequence[int] = (), steps: int = 1, logprobs: bool = False,
             masks: np.ndarray | None = None, prompt_logprobs: bool = False):
        now = time.perf_counter()
        if self._host_from is not None:  # the scheduler's work since the last call, as it ran here
            self.clock += now - self._host_from
        R = self.layout.rows_per_group
        p = self.layout.program(step.tokens.shape[1] - R, steps, logprobs, masks is not None,
                                prompt_logprobs)
        ready = self._ready.get(p)
        if ready is None:  # not prepared: compiled when first called
            ready = self._ready[p] = self.clock + self._costs.compile(p)
        wait = max(0.0, ready - self.clock)
        self.compile_wait_s += wait
        self.clock += wait
        emitted, contexts = self._emit(step, p.steps, set(stop_ids))
        chunk_at = int(step.positions[:, R].max()) if p.chunk else 0
        t = self._costs.call(p, contexts, chunk_at)
        self.clock += t
        self.device_s += t
        self.programs.add(p.name)
        self.calls.append(p.name)
        self.per_program.setdefault(p.name, []).append(t)
        scores = _Nothing() if logprobs else None
        self._host_from = time.perf_counter()
        return emitted, scores, _Nothing() if prompt_logprobs else None

    def _emit(self, b: Step, steps: int, stops: set[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """The tokens [B, steps] the device would return (-1 where a row did not sample), the
        call ended where the engine's loop ends it (`goes_on`), and each step's live decoding
        rows' contexts."""
        G, R = b.sample_at.shape
        B = G * R
        out = np.full((B, steps), -1, np.int32)
        live, count = b.live.copy(), b.count.astype(np.int64).copy()
        pos = b.positions[:, :R].reshape(B).astype(np.int64)
        decoding = live & (pos >= 0)
        contexts = [pos[decoding] + 1]
        for i in range(steps):
            if i and not goes_on(i, steps, b.live, live, b.refill):
                break
            if i:
                contexts.append(pos[live] + 1)
            for row in np.nonzero(live)[0]:
                j, k = self._who[int(b.seed[row])]  # request j's sample k: GO until its last token
                t = STOP if count[row] + 1 >= self._lengths[j][k] else GO
                out[row, i] = t
                count[row] += 1
                if t in stops or count[row] >= b.max_tokens[row]:
                    live[row] = False
            pos += 1
        return out, contexts


def simulate(layout: Layout, requests: Sequence[Request], lengths: Sequence[Sequence[int]],
             costs: Costs, longest_first: bool, head: float = 0.0) -> Outcome:
    """requests (each sample's completion `lengths[i][k]` tokens, at least 1, at most its
    max_tokens) through the Scheduler on a stand-in for an engine of `layout`, whose programs
    begin to compile `head` seconds before the scheduler starts (the job's weights' load)."""
    # Each request's seed is its index (StandIn names rows by seed); no format (a format's masks
    # would need its real tokens).
    sim = [dataclasses.replace(r, seed=i, constraint=None) for i, r in enumerate(requests)]
    stand = StandIn(layout, sim, lengths, costs, head)
    ends, tokens = [], [0]  # the clock at each call's end that ended requests; their tokens

    def done(ended) -> None:
        ends.append(stand.clock)
        tokens[0] += sum(len(c.token_ids) for _, cs in ended for c in cs)

    stats = Scheduler(stand, sim, (STOP,), None, longest_first).run(done)
    stand.clock += time.perf_counter() - stand._host_from  # the last call's aftermath
    host = stand.clock - stand.device_s - stand.compile_wait_s  # the stand-in's own work excluded
    per = {n: (len(ts), sum(ts)) for n, ts in stand.per_program.items()}
    return Outcome(stats, stand.clock, stand.device_s, host, stand.compile_wait_s,
                   ends[0] if ends else 0.0, tokens[0], stand.calls, per)


# --- completion lengths -----------------------------------------------------------------------

def lengths_from(requests: Sequence[Request], ids: Sequence, mode: str, mean: int = 0,
                 results: dict | None = None, drawn_mean: float = 0.0) -> list[list[int]]:
    """Each sample's completion length under an assumption: "max_tokens" (its max_tokens),
    "mean" (min(max_tokens, mean)), or "results" (the length the results file `results` gives
    its id, {id: [a length per sample]}; a request not there draws one of the file's lengths,
    deterministically, the draws scaled to a mean of `drawn_mean` where one is given),
    each capped by its max_tokens and at least 1."""
    if mode == "results":
        pool = sorted(n for ls in (results or {}).values() for n in ls)
        if not pool:
            raise ValueError("the results file holds no completion lengths")
        rng = np.random.default_rng(0)
    out, drawn = [], []  # drawn: (request, sample) of each length drawn from the file's
    for j, (r, i) in enumerate(zip(requests, ids)):
        if mode == "max_tokens":
            want = [r.max_tokens] * r.n
        elif mode == "mean":
            want = [mean] * r.n
        else:
            known = results.get(i)
            want = [known[k % len(known)] if known else int(pool[rng.integers(len(pool))])
                    for k in range(r.n)]
            drawn += [] if known else [(j, k) for k in range(r.n)]
        out.append(want)
    if drawn and drawn_mean:
        scale = drawn_mean / np.mean([out[j][k] for j, k in drawn])
        for j, k in drawn:
            out[j][k] = round(out[j][k] * scale)
    return [[max(1, min(r.max_tokens, n)) for n in want] for r, want in zip(requests, out)]


@dataclasses.dataclass(frozen=True)
class Spread:
    """What a pilot's completion lengths say of a job's: the job has `samples` samples, of which
    `unknown` are not in the pilot (they draw its lengths); the pilot holds `pilot` lengths, of
    mean `mean` and standard deviation `sd`. [low, high] is a `level` interval of the unknown
    samples' mean length: Student's t prediction interval of the mean of `unknown` more draws
    from what the pilot is a sample of, mean +/- t x sd x sqrt(1/pilot + 1/unknown)."""

    samples: int
    unknown: int
    pilot: int
    mean: float
    sd: float
    level: float = 0.95

    @classmethod
    def of(cls, requests: Sequence[Request], ids: Sequence, results: dict, level: float = 0.95) -> Spread:
        pool = [n for ls in results.values() for n in ls]
        unknown = sum(r.n for r, i in zip(requests, ids) if not results.get(i))
        return cls(sum(r.n for r in requests), unknown, len(pool), float(np.mean(pool)),
                   float(np.std(pool, ddof=1)) if len(pool) > 1 else 0.0, level)

    @property
    def half(self) -> float:
        """The interval's half-width (0 where nothing is unknown; infinite with a pilot of one)."""
        if not self.unknown:
            return 0.0
        if self.pilot < 2:
            return math.inf
        t = stdtrit(self.pilot - 1, (1 + self.level) / 2)
        return float(t * self.sd * math.sqrt(1 / self.pilot + 1 / self.unknown))

    @property
    def low(self) -> float:
        return max(1.0, self.mean - self.half)

    @property
    def high(self) -> float:
        return self.mean + self.half

    def pilot_for(self, relative: float, goal: float = 0.10) -> int:
        """The size of a pilot of the job's own samples, its lengths as spread as this pilot's,
        whose interval of the wall time would be +/- `goal` where this one's is +/- `relative`
        (0 where it is already). Of the job's mean length, a pilot of n of its N samples leaves
        the other N - n unknown: the interval's half-width is (N - n) / N x t(n - 1) x sd x
        sqrt(1/n + 1/(N - n)) = t(n - 1) x sd x sqrt(1/n - 1/N), which the wall's follows."""
        N = self.samples
        now = self.unknown / N * self.half
        if relative <= goal or not 0 < now < math.inf:
            return 0
        width = lambda n: stdtrit(n - 1, (1 + self.level) / 2) * self.sd * math.sqrt(1 / n - 1 / N)
        lo, hi = 2, N  # width(N) = 0 <= goal; the width falls as n grows
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if relative * width(mid) / now <= goal else (mid + 1, hi)
        return lo


def read_results(path: str) -> dict:
    """{request id: [completion tokens per sample]} from a results file (podrun's lines or a
    Batch output's); lines with an error are left out."""
    out = {}
    for line in epath.Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        key = d.get("custom_id", d.get("id"))
        body = d.get("response", {}).get("body", d) if "custom_id" in d else d
        if body is None or "error" in body and body.get("error"):
            continue
        choices = body.get("choices")
        if choices and all("token_ids" in c for c in choices):
            out[key] = [len(c["token_ids"]) for c in choices]
        elif "token_ids" in body:
            out[key] = [len(body["token_ids"])]
        elif "usage" in body:
            n = len(choices) if choices else 1
            out[key] = [body["usage"]["completion_tokens"] // n] * n
    return out


def nearest(measured: dict[int, float], chunk: int) -> float:
    """A chunk size's time from the measured ones: the next larger measured chunk's (a chunk
    costs at most its bucket's), else the largest's."""
    keys = sorted(measured)
    return measured[keys[min(bisect.bisect_left(keys, chunk), len(keys) - 1)]]
