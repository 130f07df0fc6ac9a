"""A job's wall time, tokens/s, time to first result and chip-hours, before it is launched.

    python -m runner.tools.plan --config=configs/smollm2_cpu.py --config.io.input=requests.jsonl \
        [--completion_from=pilot_results.jsonl | --completion_tokens=60] \
        [--compare=generation.batch_size=4,8,16] [--price_per_chip_hour=1.2]
    python -m runner.tools.plan --config=configs/gptoss_v5e.py --config.io.input=requests.jsonl \
        --tokenizer=DIR --compare=mesh.tpu_topology=v5e:2x4,v5e:4x4      # predicted, no TPU here
    python -m runner.tools.plan --config=configs/llama3_h100.py --config.io.input=requests.jsonl \
        --tokenizer=DIR --gpu=h100                                       # predicted, no GPU here

The request file is read and tokenized as runner.main reads it, and the job is simulated through
the real Scheduler on a stand-in engine (runner/tools/simulate.py): each sample's completion
length is an assumption (its max_tokens by default, --completion_tokens, or a results file of an
earlier run), each call costs its program's time, and the scheduler's own host work between calls
is timed as it runs here. A program's time per call is either
- measured (the config's devices are here: no mesh.tpu_topology): the engine built on the
  checkpoint's weights (random ones of the same shapes when it is not here), every program the
  scheduler predicts compiled and called a few times at two fills of the pool; a decode step costs
  a + b x (positions its rows attend), a mixed step its chunk's measured time + b x the same; or
- predicted (mesh.tpu_topology, compiled ahead of time by runner.tools.compile; or --gpu, the
  programs lowered on this CPU for the GPU's kernels): a step costs
  max(bytes / HBM bandwidth, flops / peak), the bytes the floor it must read (the weights on a
  chip and the KV pages its rows attend), the flops XLA's cost analysis of the compiled program,
  plus a stated overhead per call.
docs/plan.md gives the model, its blind spots and how a first real run calibrates it.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from absl import app, flags

from models.registry import Model
from runner.api import formats
from runner.api.common import read_lines
from runner.checkpoints.load import open_checkpoint, restore
from runner.cli import config_flag, parse_flags, read_config, setup_devices
from runner.engine import Engine, Request, Scheduler
from runner.engine.build import build_engine
from runner.engine.engine import Layout, Program
from runner.engine.sampling import CANDIDATES
from runner.errors import USER_ERRORS
from runner.settings import Settings, from_config
from runner.text.tokenizer import load_tokenizer, read_chat_template
from runner.tools.bench import random_weights
from runner.tools.memory import describe, footprint
from runner.tools.simulate import Costs, Outcome, Spread, lengths_from, nearest, read_results, simulate
from sharding.mesh import make_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # flags of this command only, so the module can be imported
    _CONFIG = config_flag()
    _COMPLETION_TOKENS = flags.DEFINE_integer(
        "completion_tokens", 0, "assume each sample's completion is this many tokens (at most its "
        "max_tokens); 0: its max_tokens")
    _COMPLETION_FROM = flags.DEFINE_string(
        "completion_from", "", "a results file of an earlier run (a pilot): each request's completion "
        "length from it, others drawn from its lengths")
    _COMPARE = flags.DEFINE_string("compare", "", "KEY=V1,V2,...: also plan the config with each value "
                                   "(e.g. generation.batch_size=4,8,16 or mesh.tpu_topology=v5e:2x4,v5e:4x4)")
    _PRICE = flags.DEFINE_float("price_per_chip_hour", 0.0, "price of one chip-hour (0: no cost)")
    _MODE = flags.DEFINE_enum("mode", "auto", ["auto", "measure", "predict"],
                              "auto: predict for a config with mesh.tpu_topology, else measure")
    _REPS = flags.DEFINE_integer("reps", 1, "timed calls of each program and fill (the median is used)")
    _TOKENIZER = flags.DEFINE_string("tokenizer", "", "a directory with the tokenizer, when "
                                     "checkpoint.path is not on this machine")
    _JSON = flags.DEFINE_string("json", "", "also write each deployment's figures to this file (JSON)")
    _GPU = flags.DEFINE_enum("gpu", "", ["", "h100", "h200"], "predict for this NVIDIA GPU (a "
                             "deployment of GPUs, none of them here): the mesh's programs lowered "
                             "on this machine's CPU for their flops")

# Chips for predicted plans: (HBM GB/s, peak dense bf16 TFLOP/s, HBM GiB), from the vendors' sheets.
CHIPS = {"v5e": (819, 197, 16), "v5p": (2765, 459, 95), "v6e": (1640, 918, 32),
         "h100": (3350, 989, 80), "h200": (4800, 989, 141)}
CALL_OVERHEAD_S = 100e-6  # predicted: a call's dispatch, its batch's transfer and its tokens' return
LOAD_GBPS = 2.0  # predicted: the weights read from storage at this rate (all hosts together)
SPENT: dict[str, float] = collections.defaultdict(float)  # the plan's own time, by part


@contextlib.contextmanager
def spending(part: str):
    """The block's time added to SPENT[part]."""
    t0 = time.perf_counter()
    yield
    SPENT[part] += time.perf_counter() - t0


@dataclasses.dataclass
class Loader:
    """The model measured plans run on: its metadata and rules at once, its weights read (or
    drawn) when first asked for, so that the first plan's programs compile meanwhile, as the
    job's do while its weights restore."""

    meta: Any
    rules: Any
    read: Callable[[], Any]
    label: str  # the startup part its reading is: "load", or random weights'
    params: Any = None
    load_s: float = 0.0

    def get(self) -> Any:
        if self.params is None:
            t0 = time.perf_counter()
            self.params = self.read()
            self.load_s = time.perf_counter() - t0
        return self.params


@dataclasses.dataclass
class Job:
    """The request file as the job would see it."""

    requests: list[Request]
    ids: list
    invalid: list[str]  # why each request the job would refuse is refused
    tokenize_s: float


def read_job(s: Settings, model, tokenizer_dir: str = "") -> Job:
    """s.input tokenized and parsed exactly as runner.job.answer does, the errors kept apart."""
    t0 = time.perf_counter()
    lines = read_lines(s.input)
    fmt = formats.file_format(lines)
    where = tokenizer_dir or s.checkpoint_path
    if "://" in where and not tokenizer_dir:
        raise ValueError(f"checkpoint.path={where} is not on this machine: give --tokenizer=DIR, a "
                         "directory with the model's tokenizer (tokenizer.json)")
    tokenizer = load_tokenizer(os.path.expanduser(where),
                               read_chat_template(s.chat_template))
    parse = formats.request_parser(s, model, tokenizer, fmt)[2]
    parsed = [parse(i, line) for i, line in enumerate(lines)]
    good = [p for p in parsed if not p.error]
    invalid = [f"request {p.id!r}: {p.error}" for p in parsed if p.error]
    return Job([p.request() for p in good], [p.id for p in good], invalid, time.perf_counter() - t0)


def never_admitted(L: Layout, requests: list[Request]) -> list[str]:
    """The requests no state of the pool admits: a prompt and one token need more pages than a
    group's pool holds (Scheduler._admit), or the engine refuses their lengths."""
    out = []
    for i, r in enumerate(requests):
        need = -(-(len(r.prompt) + 1) // L.page_size)
        if need > L.pages:
            out.append(f"request {i}: {len(r.prompt)} prompt tokens need {need} pages, the pool holds "
                       f"{L.pages}")
        elif not 0 < len(r.prompt) <= L.max_prompt_len or r.max_tokens > L.max_new_tokens:
            out.append(f"request {i}: {len(r.prompt)} prompt tokens, max_tokens={r.max_tokens} exceed "
                       f"max_prompt_len={L.max_prompt_len} or max_new_tokens={L.max_new_tokens}")
    return out


# --- measured: time per call on the devices present --------------------------------------------

@dataclasses.dataclass
class Measured(Costs):
    """Decode: a call of n steps costs sum over its steps of (a + b x positions its live rows
    attend). Mixed step of chunk C: mixed[C] (measured with every other row decoding at `fill`
    positions) + b x (positions its decoding rows attend - those of the measurement)."""

    a: float
    b: float
    mixed: dict[int, float]
    fill_kv: int  # positions the decoding rows of a mixed measurement attended
    compiles: dict[Program, float]
    fills: tuple[int, int]

    def call(self, p: Program, contexts: list[np.ndarray], chunk_at: int) -> float:
        if p.chunk:
            return max(0.0, nearest(self.mixed, p.chunk) + self.b * (float(contexts[0].sum()) - self.fill_kv))
        return sum(self.a + self.b * float(c.sum()) for c in contexts)

    def compile(self, p: Program) -> float:
        return self.compiles.get(p, statistics.mean(self.compiles.values()) if self.compiles else 0.0)

    def describe(self) -> list[str]:
        mixed = ", ".join(f"mixed_{c} {1e3 * t:.1f} ms" for c, t in sorted(self.mixed.items()))
        return [(f"measured here: a decode step {1e3 * self.a:.2f} ms + {1e6 * self.b:.3f} us per "
                 f"position its rows attend (fit over rows at {self.fills[0]} and {self.fills[1]} "
                 f"positions); {mixed} with every other row decoding, each +/- the same per position")]


def _probe(engine: Engine, C: int, fill: int, like: Request, steps: int = 0):
    """A call's batch: every row decoding at `fill` positions, except with C > 0 the last row of
    each group, which computes a chunk of C tokens from `fill` on and samples after it; with
    steps > 0, every row stops after that many tokens (a decode call of that many steps)."""
    L = engine.layout
    b = L.empty_step(C)
    G, R = L.groups, L.rows_per_group
    # A sampled row draws among the CANDIDATES largest logits, or over the whole vocabulary when
    # its nucleus reaches past them (flat logits: what a probe's made-up tokens give, and text
    # rarely does): a top_k below CANDIDATES keeps the probe on the first, text's usual way.
    top_k = like.top_k if 0 < like.top_k < CANDIDATES else CANDIDATES // 2
    per_row = L.pages // R
    for g in range(G):
        for r in range(R):
            row = g * R + r
            n = min(per_row, L.max_pages)  # the row's own pages: rows never share one
            b.tables[g, r, :n] = np.arange(r * per_row, r * per_row + n)
            b.max_tokens[row], b.count[row] = steps or L.max_new_tokens, 0
            b.temperature[row], b.top_k[row], b.top_p[row] = like.temperature, top_k, like.top_p
            b.live[row] = True
            if C and r == R - 1:
                b.tokens[g, R:] = 1
                b.positions[g, R:] = np.arange(fill, fill + C)
                b.rows[g, R:] = r
                b.sample_at[g, r] = R + C - 1
            else:
                b.tokens[g, r], b.positions[g, r] = 1, fill
    return b


def measure(engine: Engine, programs: list[Program], like: Request, fills: tuple[int, int],
            reps: int) -> Measured:
    """Every program compiled (timed: the compilation, or its load from the persistent cache;
    prepared ones are compiling already, one after another) and called: one untimed call as soon
    as it is compiled, while the thread compiles the next, then `reps` timed ones (the median),
    decode at both fills."""
    times = {}
    L = engine.layout
    kinds = list(dict.fromkeys(L.program(p.chunk, p.steps) for p in programs))
    uncalled = set(kinds)
    for p in programs:
        with spending("compile"):
            engine.executable(p)
        if (q := L.program(p.chunk, p.steps)) in uncalled:  # a program's first call does what
            with spending("first calls"):  # later ones do not (buffers, pages): one step will do
                engine.call(_probe(engine, q.chunk, fills[0], like, steps=1), (), q.steps)
            uncalled.remove(q)
    compiles = {p: engine.compile_s[p] for p in programs}
    # The weights and pool move onto 2 MiB pages on a thread while the programs compile (CPU): a
    # job runs its calls on them but for its first few, so the calls are timed once they are.
    engine.huge_pages  # noqa: B018
    with spending("timed calls"):
        for p in kinds:
            for fill in fills if not p.chunk else fills[:1]:
                b = _probe(engine, p.chunk, fill, like)
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    engine.call(b, (), p.steps)
                    ts.append(time.perf_counter() - t0)
                times[p, fill] = statistics.median(ts)
    decode = L.program(0, L.steps)
    kv = lambda fill: L.batch_size * (fill + 1 + (L.steps - 1) / 2)  # positions a step attends
    a = b = 0.0
    if (decode, fills[0]) in times:
        per = [times[decode, f] / L.steps for f in fills]
        b = max(0.0, (per[1] - per[0]) / (kv(fills[1]) - kv(fills[0])))
        a = max(0.0, per[0] - b * kv(fills[0]))
    mixed = {p.chunk: t for (p, _), t in times.items() if p.chunk}
    return Measured(a, b, mixed, L.groups * (L.rows_per_group - 1) * (fills[0] + 1), compiles, fills)


# --- predicted: time per call from XLA's cost analysis -----------------------------------------

@dataclasses.dataclass
class Predicted(Costs):
    """A step costs max((weights + KV bytes read) / bandwidth, flops / peak) per chip, a call
    CALL_OVERHEAD_S more. Weights: the declared weights on the busiest chip, read once a step
    (runner.tools.memory). KV bytes: the positions the step's rows attend x a position's keys and
    values on a chip (the windowed layers' at most `window` positions a row), a chunk's pages read
    once. Flops: XLA's cost analysis of the AOT-compiled program per chip (a decode call's loop
    body counted once: one step). XLA's bytes accessed are shown beside the floor, not used: on
    TPU they count each prefetch into VMEM as a read and a write besides the consumer's read
    (docs/benchmarks/tpu-gptoss-v5e.md: 2.36x the floor as deployed, 1.13x without prefetches)."""

    chip: str
    compiled: dict  # program name -> runner.tools.compile.Compiled
    weight_bytes: float  # per chip
    kv_position_bytes: float  # the full-attention layers'
    window_position_bytes: float = 0.0  # the windowed layers'
    window: int = 0

    def _kv(self, ctx: np.ndarray) -> float:
        windowed = np.minimum(ctx, self.window) if self.window else ctx
        return self.kv_position_bytes * float(ctx.sum()) + self.window_position_bytes * float(windowed.sum())

    def call(self, p: Program, contexts: list[np.ndarray], chunk_at: int) -> float:
        bw, peak, _ = CHIPS[self.chip]
        c = self.compiled.get(Program(p.chunk, p.steps).name) or nearest(
            {int(n.split("_")[1]): c for n, c in self.compiled.items() if n.startswith("mixed_")},
            p.chunk)
        chunk = self._kv(np.array([chunk_at + p.chunk])) if p.chunk else 0.0  # its pages, read once
        step = lambda ctx, extra: max((self.weight_bytes + self._kv(ctx) + extra) / (bw * 1e9),
                                      c.flops / (peak * 1e12))
        return CALL_OVERHEAD_S + sum(step(ctx, chunk if i == 0 else 0.0) for i, ctx in enumerate(contexts))

    def describe(self) -> list[str]:
        bw, peak, _ = CHIPS[self.chip]
        xla = ", ".join(f"{n} {c.bytes_accessed / 1e9:.2f} GB {c.flops / 1e9:.0f} GFLOP"
                        for n, c in self.compiled.items() if not c.error)
        return [(f"predicted for {self.chip} ({bw} GB/s HBM, {peak} TFLOP/s bf16 per chip): a step "
                 f"max(({self.weight_bytes / 1e9:.2f} GB of weights + {self.kv_position_bytes / 1e3:.1f} kB "
                 f"per position attended) / bandwidth, XLA's flops / peak) + {1e6 * CALL_OVERHEAD_S:.0f} us "
                 "per call"),
                f"XLA's cost analysis per chip (a decode call: one step; bytes not used, see docs/plan.md): {xla}"]


def lowered_costs(s: Settings, model) -> tuple[Engine, dict]:
    """A GPU deployment's programs, none of its GPUs here: its engine built for the GPU's kernels
    (XLA's, kernels.* off, as the shipped GPU configs run) on this machine's CPU
    devices as its mesh, each program lowered (not compiled) and XLA's cost analysis of it per
    device (the lowered program is the whole mesh's: its flops over the devices)."""
    from runner.tools.compile import Compiled, xla_cost  # libtpu's topologies: predicted plans only

    s = dataclasses.replace(s, policy=dataclasses.replace(s.policy, kernels=False))
    rules = dataclasses.replace(Rules.make(make_mesh(s.mesh, jax.devices("cpu")), s.rules),
                                target="gpu")
    engine = build_engine(s, model, model.abstract_params(rules, s.policy), rules, allocate=False)
    return engine, {name: Compiled(name, 0, 0, 0, 0, *xla_cost(p.cost_analysis(), rules.mesh.size))
                    for name, p in engine.lower().items()}


def chip_of(topology: str) -> str:
    kind = topology.split(":")[0].lower()
    if kind not in CHIPS:
        raise ValueError(f"no figures for chip {kind!r} ({topology}); known: {sorted(CHIPS)}")
    return kind


# --- one plan ---------------------------------------------------------------------------------

@dataclasses.dataclass
class Plan:
    label: str
    chips: int
    outcome: Outcome | None
    startup: dict[str, float]  # the job's time before its first call, by part
    costs: Costs | None
    problems: list[str]
    spread: Spread | None = None  # what a pilot's lengths say of the job's
    ends: tuple[Outcome, Outcome] | None = None  # the job simulated at the spread's low and high

    @property
    def wall_s(self) -> float:
        return sum(self.startup.values()) + self.outcome.generate_s

    @property
    def wall_range(self) -> tuple[float, float] | None:
        """The wall time at the ends of the pilot's interval of the job's lengths."""
        if self.ends is None:
            return None
        return tuple(sorted(sum(self.startup.values()) + o.generate_s for o in self.ends))

    @property
    def pilot_for(self) -> int | None:
        """The pilot that would narrow the wall time's range to +/-10% (0: it is already)."""
        if self.wall_range is None:
            return None
        lo, hi = self.wall_range
        return self.spread.pilot_for((hi - lo) / 2 / self.wall_s)

    def record(self, price: float) -> dict:
        """The row's figures, for --json."""
        if self.problems or self.outcome is None:
            return {"label": self.label, "problems": self.problems}
        o, hours = self.outcome, self.wall_s * self.chips / 3600
        return {"label": self.label, "wall_s": self.wall_s, "generate_s": o.generate_s,
                "startup_s": sum(self.startup.values()), "first_result_s": o.first_result_s,
                "completion_tokens": o.completion_tokens, "prompt_tokens": o.stats.prompt_tokens,
                "calls": len(o.calls), "chips": self.chips, "chip_hours": hours,
                "cost": hours * price if price else None, "preemptions": o.stats.preemptions,
                "wall_s_range": self.wall_range, "pilot_for_10pct": self.pilot_for}

    def row(self, price: float) -> str:
        if self.problems or self.outcome is None:
            return f"  {self.label:<{COLUMNS[0][1]}} does not run: {self.problems[0].splitlines()[0]}"
        o = self.outcome
        hours = self.wall_s * self.chips / 3600
        span = "{:.1f}-{:.1f}".format(*self.wall_range) if self.wall_range else "-"
        return table_line([self.label, f"{self.wall_s:.1f}", span, f"{o.completion_tokens / o.generate_s:.1f}",
                           f"{sum(self.startup.values()) + o.first_result_s:.1f}", f"{hours:.4f}",
                           f"{hours * price:.2f}" if price else "-", str(o.stats.preemptions),
                           f"{100 * o.stats.utilisation:.0f}%"])


# The table's columns (header, width): each at least 2 wider than its header, so that no header
# (some hold a space) or value runs into the next.
COLUMNS = (("deployment", 28), ("wall s", 9), ("wall range", 15), ("tok/s", 10), ("first s", 9),
           ("chip-hours", 12), ("cost", 9), ("preempt", 9), ("rows", 7))


def table_line(cells: list[str]) -> str:
    """A line of the table: the label left-aligned, the other cells right-aligned in COLUMNS."""
    (_, first), *rest = COLUMNS
    return f"  {cells[0]:<{first}}" + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells[1:], rest))


def plan_one(s: Settings, label: str, mode: str, loaded: Loader | None, job: Job | None,
             completion: tuple, reps: int, startup: dict[str, float], tokenizer_dir: str = "",
             gpu: str = "") -> tuple[Plan, Job]:
    """The plan of one deployment: its engine, its fit, its costs, its simulated job; predicted
    for its TPU topology, or for `gpu` (a chip of CHIPS) when it has none."""
    model = loaded.meta.model if loaded else Model.named(s.checkpoint_model)
    problems, startup = [], dict(startup)
    f = footprint(s, model)
    if f.device_memory and f.per_device > f.device_memory:
        problems.append(f"weights and KV cache need {f.per_device / 2**30:.2f} GiB per device, more than "
                        f"its {f.device_memory / 2**30:.1f} GiB\n" + describe(f, model))
    if job is None:
        job = read_job(s, model, tokenizer_dir)
    startup["tokenize"] = job.tokenize_s
    if problems:  # before anything is allocated or compiled
        return Plan(label, f.devices, None, startup, None, problems), job
    t0 = time.perf_counter()
    if mode == "measure":  # before the weights are read, on their declaration, as the job
        rules = loaded.rules
        engine = build_engine(s, model, model.abstract_params(rules, s.policy) if loaded.params is None
                              else loaded.params, rules, allocate=loaded.params is not None)
        chips = rules.mesh.size
    else:
        if s.tpu_topology:
            from runner.tools.compile import compile_deployment  # libtpu's topologies

            with spending("AOT compile"):
                engine, compiled = compile_deployment(s, model)
        else:
            with spending("lowering"):
                engine, compiled = lowered_costs(s, model)
        chips = engine.rules.mesh.size
        problems += [f"{c.name} does not fit a chip: {c.error}" for c in compiled.values() if c.error]
    startup["engine"] = time.perf_counter() - t0
    L = engine.layout
    problems += never_admitted(L, job.requests)
    if problems:
        return Plan(label, chips, None, startup, None, problems), job
    kind, mean, results = completion
    lengths = lengths_from(job.requests, job.ids, kind, mean, results)
    programs = Scheduler(engine, job.requests, longest_first=s.generation.longest_first).programs()
    head = 0.0  # how long the programs compile before the scheduler starts
    if mode == "measure":
        engine.prepare(programs)  # on a thread: while the weights are read, or the calls run
        if loaded.params is None:
            engine.load(loaded.get())
        # the job's programs compile while its weights load, as the first plan's did
        startup[loaded.label] = head = loaded.load_s
        prompt_and_answer = sorted(len(r.prompt) + n for r, ls in zip(job.requests, lengths) for n in ls)
        top = L.pages // L.rows_per_group * L.page_size - L.chunk - L.steps - 1
        fills = (16, max(32, min(top, prompt_and_answer[int(0.9 * (len(prompt_and_answer) - 1))])))
        costs = measure(engine, programs, job.requests[0], fills, reps)
    else:
        P, S = engine.pools, s.generation.page_size
        chip = chip_of(s.tpu_topology) if s.tpu_topology else gpu
        costs = Predicted(chip, compiled, f.weights, P.page_bytes / S, P.window_page_bytes / S,
                          L.window)
        startup.pop("engine")  # this machine's AOT compile: the job's compiles are assumed cached
        startup["load (stated: weights at 2 GB/s)"] = f.total_weights / (LOAD_GBPS * 1e9)
    run = lambda lengths: simulate(L, job.requests, lengths, costs, s.generation.longest_first,
                                   head)
    spread = ends = None
    with spending("simulation"):
        outcome = run(lengths)
        if kind == "results":  # the job again at the ends of the pilot's interval of its lengths
            spread = Spread.of(job.requests, job.ids, results)
            if 0 < spread.half < math.inf:
                ends = tuple(run(lengths_from(job.requests, job.ids, kind, mean, results, drawn_mean=m))
                             for m in (spread.low, spread.high))
    return Plan(label, chips, outcome, startup, costs, [], spread, ends), job


def override(config, key: str, value: str):
    """A copy of the ConfigDict with key (dotted) set to value (a Python literal or a string)."""
    c = copy.deepcopy(config)
    try:
        value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        pass
    c.update_from_flattened_dict({key: value})
    return c


def report(plans: list[Plan], job: Job, assumption: str, price: float) -> str:
    first = plans[0]
    prompt = sum(len(r.prompt) for r in job.requests)
    lines = [f"{len(job.requests)} requests to generate, {prompt} prompt tokens; completion lengths: {assumption}"]
    if job.invalid:
        lines.append(f"{len(job.invalid)} requests the job refuses (error lines, no cost): {job.invalid[0]}")
    for p in plans:
        if p.problems:
            lines.append(f"{p.label}: DOES NOT RUN:\n  " + "\n  ".join(p.problems))
    if first.outcome is not None:
        o = first.outcome
        lines += [f"{first.label}: programs", f"  {'program':<24}{'calls':>7}{'ms/call':>10}{'share':>8}"]
        for name, (n, t) in sorted(o.per_program.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {name:<24}{n:>7}{1e3 * t / n:>10.1f}{100 * t / o.generate_s:>7.0f}%")
        host_ms = 1e3 * o.host_s / max(1, len(o.calls))
        lines += [f"  {'host (scheduler)':<24}{len(o.calls):>7}{host_ms:>10.2f}{100 * o.host_s / o.generate_s:>7.0f}%",
                  f"  {'compile waits':<24}{'':>17}{100 * o.compile_wait_s / o.generate_s:>7.0f}%"]
        lines += ["  " + x for x in first.costs.describe()]
        lines.append("  before the first call: " + ", ".join(f"{k} {v:.1f} s" for k, v in first.startup.items()))
        st = o.stats
        lines.append(f"  schedule: {len(o.calls)} calls ({st.inserts} mixed, {st.decode_calls} decode of "
                     f"{st.decode_steps} steps), {st.completion_tokens} completion tokens, "
                     f"{st.prompt_tokens_computed} prompt tokens computed, pages {st.pages_peak} peak of "
                     f"{st.pages}, {st.preemptions} preemptions")
        if first.spread is not None:
            lines.append("  " + spread_line(first, len(job.requests)))
    lines.append(table_line([name for name, _ in COLUMNS]))
    lines += [p.row(price) for p in plans]
    return "\n".join(lines)


def spread_line(p: Plan, requests: int) -> str:
    """What the pilot's lengths make of plan p's wall time: its range, or why there is none."""
    sp = p.spread
    if p.wall_range is None:
        why = ("every sample's length is the pilot's own" if not sp.unknown else
               "the pilot holds one length" if sp.pilot < 2 else f"the pilot's lengths are all {sp.mean:.0f}")
        return f"wall time: no range ({why})"
    lo, hi = p.wall_range
    what = "requests" if sp.samples == requests else "samples"
    more = (f"a pilot of {p.pilot_for} of the job's {what} would narrow it to +/-10%" if p.pilot_for
            else "within +/-10%")
    return (f"wall time {lo:.1f}-{hi:.1f} s at the ends of a {100 * sp.level:.0f}% interval of the mean "
            f"length of the {sp.unknown} samples not in the pilot, {sp.low:.1f}-{sp.high:.1f} tokens (the "
            f"pilot's {sp.pilot} lengths: mean {sp.mean:.1f}, sd {sp.sd:.1f}); {more}")


def _process_age() -> float:
    """Seconds since this process started (Linux), else 0."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def main(argv: list[str]) -> None:
    started = _process_age()
    config = read_config(argv, _CONFIG.value, "podrun plan")
    if _COMPLETION_FROM.value and _COMPLETION_TOKENS.value:
        sys.exit("podrun plan: error: give --completion_from or --completion_tokens, not both")
    try:
        s = from_config(config)
        gpu = _GPU.value if not s.tpu_topology else ""
        absent = bool(s.tpu_topology or gpu)  # the deployment's devices are not these
        mode = _MODE.value if _MODE.value != "auto" else ("predict" if absent else "measure")
        if mode == "predict" and not absent:
            raise ValueError("a predicted plan is for a TPU topology (mesh.tpu_topology) or a GPU "
                             "(--gpu=h100)")
        if _COMPLETION_FROM.value:
            results = read_results(_COMPLETION_FROM.value)
            completion = ("results", 0, results)
            assumption = (f"from {_COMPLETION_FROM.value} ({len(results)} requests, the others drawn "
                          "from its lengths), capped by each request's max_tokens")
        elif _COMPLETION_TOKENS.value:
            completion = ("mean", _COMPLETION_TOKENS.value, None)
            assumption = f"{_COMPLETION_TOKENS.value} tokens each (at most its max_tokens)"
        else:
            completion, assumption = ("max_tokens", 0, None), "each request's max_tokens (the worst case)"
        alternatives = [("config", config)]
        if _COMPARE.value:
            key, _, values = _COMPARE.value.partition("=")
            if mode == "measure" and key.startswith(("mesh.", "checkpoint.", "precision.")):
                raise ValueError(f"--compare={key}: measured plans share one model on this machine's "
                                 "devices; compare meshes and precisions in predicted plans (mesh.tpu_topology)")
            alternatives += [(f"{key.split('.')[-1]}={v}", override(config, key, v))
                             for v in values.split(",") if v]
        if mode == "predict":  # before the backend starts: CPU, libtpu for topologies only
            import runner.tools.compile  # noqa: F401
        if mode == "predict" and gpu:  # the GPUs' meshes simulated on CPU devices, the largest compared
            jax.config.update("jax_platforms", "cpu")
            largest = max(from_config(c).mesh.size() or 1 for _, c in alternatives)
            s = dataclasses.replace(s, num_cpu_devices=largest)
        setup_devices(s)
        startup, loaded = {}, None
        if mode == "measure":
            startup["start"] = started  # this process' imports, as runner.main's
            t0 = time.perf_counter()
            jax.devices()
            startup["devices"] = time.perf_counter() - t0
            if os.path.exists(os.path.expanduser(s.checkpoint_path)):
                meta, rules = open_checkpoint(s)
                loaded = Loader(meta, rules, lambda: restore(s, meta, rules), "load")
            else:
                loaded = Loader(*random_weights(s), "load (random weights: not the job's)")
        plans, job = [], None
        for label, c in alternatives:
            p, job = plan_one(from_config(c), label, mode, loaded, job, completion, _REPS.value, startup,
                              _TOKENIZER.value, gpu)
            plans.append(p)
    except (*USER_ERRORS, ValueError) as e:
        sys.exit(f"podrun plan: error: {e}")
    print(report(plans, job, assumption, _PRICE.value))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump([p.record(_PRICE.value) for p in plans], f, indent=1)
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in SPENT.items())
    print(f"planned in {_process_age():.1f} s ({parts}; the rest: imports, load, tokenizing, engines)")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
