"""Generation speed of a deployment: time to first token, decode throughput, and how close a decode
step comes to the machine's memory bandwidth (MBU) and peak flops (MFU), and a prefill to its flops.

    python -m runner.tools.bench --config=configs/smollm2_cpu.py --batch_sizes=1,8 --prompt_len=128 \
        --new_tokens=128 [--prompt_lens=128,512] [--reps=3] [--output=results.json]
    python -m runner.tools.bench --config=configs/llama3_h100.py --random_weights --batch_sizes=1,64
    python -m runner.tools.bench --config=configs/smollm2_cpu.py --requests=requests.jsonl   # a whole job

--random_weights draws checkpoint.model's weights at random on the devices instead of restoring
the checkpoint: an 8B model's 16 GB are made where they are used, and nothing is read.

Same config files and overrides as runner.main; the config's generation.batch_size,
max_prompt_len and max_new_tokens are replaced by the workload: for each batch size B one engine
of B rows (rounded up to the `data` axis as always), its pool holding every row at its longest
(no preemption). Prompts are seeded random ids of exactly prompt_len tokens and no id stops a row,
so every row decodes all new_tokens.

Measured (medians over --reps, after a warm-up that compiles every timed shape):
  prefill_s        wall time of a 1-token generation (every prompt computed in chunks, one row a
                   group at a time, and its first token on the host)
  ttft_s           time to first token inside the new_tokens generation (the engine's own clock)
  decode tokens/s  B / decode_step_s, where decode_step_s is the wall time of the generation's
                   decode calls over their steps (the scheduler's own clock: no prompt's chunk in
                   them); decode_s = decode_step_s * (N - 1).
  compile_s        warm-up wall time less one timed run of each shape (compilation, or loading it
                   from the persistent compilation cache)
Roofline of one decode step: bytes_per_step = weights a token must read (all of them, except that
an embedding table only contributes the B rows gathered unless it is tied as the unembedding, a
mixture of experts only min(B*k, E) of its E experts, and an unembedding read through the greedy
screen (kernels.greedy_screen) only the screen's int8 bytes) + the filled part of the KV cache
(mean over the decode), against a large array's read bandwidth measured in this process before
each timed repetition and after the last (the bandwidth of a machine like this one drifts by a
half within minutes) -> MBU: each repetition's decode against the mean of the two measurements
around it, the median over repetitions (mbu_all holds each; bandwidth_gbps is the measurements'
median);
flops_per_step = 2 * B * params per token + attention, against a large matmul in the activations'
dtype -> MFU (prefill_flops: every prompt token's, causal attention, one unembedding a row). Counted
once for the model: replicas over the `data` axis that each read their own copy of the weights (8
simulated CPU devices) are not counted again, so their extra reads show up as a lower MBU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from models import quant, weights
from models.kernels import cpu
from models.paged import PagedCache
from models.registry import Model
from models.weights import check_divisible, is_lookup_table, is_weight
from runner import job, log
from runner.checkpoints import store
from runner.checkpoints.load import load_model
from runner.cli import config_flag, parse_flags, read_config, setup_devices
from runner.engine import Completion, Engine, Request, Scheduler, Stats, hugepages
from runner.errors import USER_ERRORS
from runner.settings import Settings, from_config
from runner.tools.memory import GiB
from sharding.mesh import make_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # flags of this command only, so the module can be imported
    _CONFIG = config_flag()
    _BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "batch sizes to measure")
    _PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "prompt length (tokens)")
    _PROMPT_LENS = flags.DEFINE_list("prompt_lens", [], "several prompt lengths (replaces --prompt_len)")
    _NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens generated per row")
    _REPS = flags.DEFINE_integer("reps", 3, "timed repetitions per shape (medians are reported)")
    _SEED = flags.DEFINE_integer("seed", 1234, "seed of the random prompts")
    _OUTPUT = flags.DEFINE_string("output", "", "write the records as JSON here")
    _BANDWIDTH = flags.DEFINE_float("bandwidth_gbps", 0.0, "memory read bandwidth for MBU (0 = measure)")
    _PEAK = flags.DEFINE_float("peak_gflops", 0.0, "peak flops for MFU, GFLOP/s (0 = measure)")
    _PROBE_MIB = flags.DEFINE_integer("probe_mib", 512, "array size of the bandwidth measurement")
    _PROBE_MATMUL = flags.DEFINE_integer("probe_matmul", 2048, "per-device matmul size of the flops probe")
    _REQUESTS = flags.DEFINE_string("requests", "", "job mode: run this request file (runner.main's "
                                    "format) through the whole engine instead of fixed shapes")
    _RANDOM = flags.DEFINE_bool("random_weights", False, "draw checkpoint.model's weights at random "
                                "on the devices instead of restoring checkpoint.path")
    _MEMORY = flags.DEFINE_bool("memory_analysis", False, "record the compiled decode step's buffers "
                                "(XLA's memory analysis; compiles it once more, or loads it from "
                                "the compilation cache)")


class BenchError(ValueError):
    """The workload cannot be run as asked."""


# --- roofline of a decode step ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """What one decode step of B rows must read and compute at the least, averaged over the decode."""

    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def _token_shares(model: Model) -> list[tuple[Any, str, float]]:
    """Each declared weight, its role ("unembedding", "table": a lookup table, which a token only
    indexes, or "") and the share of it one token multiplies by (k / E of an expert weight)."""
    decl = model.declare()
    unembedding = model.unembedding(decl).w
    k = getattr(model.config, "experts_per_token", 0)
    out = []
    for path, w in jax.tree_util.tree_leaves_with_path(decl, is_leaf=is_weight):
        if w is unembedding:
            out.append((w, "unembedding", 1.0))
        elif is_lookup_table(path, w):
            out.append((w, "table", 0.0))
        else:
            out.append((w, "", k / w.shape[w.axes.index("experts")] if "experts" in w.axes else 1.0))
    return out


def prefill_flops(model: Model, batch: int, prompt_len: int) -> float:
    """The arithmetic of prefilling `batch` prompts of `prompt_len` tokens and taking each one's
    logits at its last position (what a prefill computes; padding not counted): 2 x the weights a
    token uses for every token, the unembedding once per prompt, and causal attention (each query
    over itself and the keys before it, or its window)."""
    shares = _token_shares(model)
    body = sum(math.prod(w.shape) * share for w, role, share in shares if role != "unembedding")
    head = sum(math.prod(w.shape) for w, role, _ in shares if role == "unembedding")
    windows, _, head_dim = model.module.cache_spec(model.config)
    seen = np.arange(1, prompt_len + 1)  # keys the query at each position attends to
    attended = sum(float(np.sum(np.minimum(seen, w) if w else seen)) for w in windows)
    attention = 4 * batch * model.config.num_heads * head_dim * attended  # QK^T and PV
    return 2 * batch * (prompt_len * body + head) + attention


def decode_cost(model: Model, batch: int, prompt_len: int, new_tokens: int, param_itemsize: int,
                kv_itemsize: float, quantize: str = "none", screen_bytes: int = 0) -> DecodeCost:
    """From the model's weight declarations and cache spec alone (nothing is allocated).

    Weights: every declared weight once per step, except embedding tables (only the `batch` rows
    gathered, unless the table is also the unembedding), expert weights (min(batch * k, E) of
    the E experts; each token uses k) and, where greedy tokens come through a screen of the
    unembedding (screen_bytes > 0, Engine.greedy_screen_bytes), the unembedding: the screen's bytes
    instead (the few rows of the unembedding it leaves to compute, kilobytes, are not counted).
    KV cache: step i of the decode (i = 1..N-1) attends over prompt_len + i positions, or the window.
    """
    weight_bytes = params_per_token = 0.0
    for w, role, share in _token_shares(model):
        params_per_token += math.prod(w.shape) * share
        if role == "unembedding" and screen_bytes:
            weight_bytes += screen_bytes
        elif role == "table":
            weight_bytes += min(batch, w.shape[0]) * w.shape[1] * param_itemsize
        else:  # int8 + scales, or as restored; of experts, the min(batch * k, E) the batch uses
            weight_bytes += quant.stored_bytes(w, param_itemsize, quantize) * min(batch * share, 1)

    windows, kv_heads, head_dim = model.module.cache_spec(model.config)
    attended = np.arange(prompt_len + 1, prompt_len + max(new_tokens, 2))  # per decode step
    per_layer = [float(np.mean(np.minimum(attended, w) if w else attended)) for w in windows]
    kv_bytes = sum(2 * batch * n * kv_heads * head_dim * kv_itemsize for n in per_layer)
    heads = model.config.num_heads
    attention_flops = sum(4 * batch * heads * head_dim * n for n in per_layer)  # QK^T and PV
    return DecodeCost(weight_bytes, kv_bytes, 2 * batch * params_per_token + attention_flops)


# --- the machine --------------------------------------------------------------------------------

def _best_of(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def _over_devices(shape: tuple[int, ...], dtype=jnp.float32, random: bool = False) -> jax.Array:
    """[local devices, *shape] of ones (or random normals), one slice on each local device."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    full = (len(devices), *shape)
    make = (lambda: jax.random.normal(jax.random.key(0), full, dtype)) if random else (
        lambda: jnp.ones(full, dtype))
    return jax.jit(make, out_shardings=sharding)()


class BandwidthProbe:
    """The machine's memory bandwidth, GB/s, measured anew at each call: bytes moved per second
    over a `mib` MiB f32 array split over every local device, by the fastest of its movers:
    - XLA's sum, which reads the array once;
    - on an accelerator, a copy (read once, written once: twice its bytes), the figure GPU
      bandwidth is usually quoted as;
    - on CPU, podrun's product kernel (ones[1, R] . W[R, 4096], its threads each streaming a
      contiguous share), which reads faster than XLA's reduction there.
    On CPU the array sits on 2 MiB pages where the system gives them, as the engine's weights do
    (runner/engine/hugepages.py). `readings` holds each mover's figure from the last call. The array
    exists while the probe is open (`with`); `measure` opens it after a record's warm-up, whose
    peak memory leaves it out."""

    def __init__(self, mib: int):
        self.mib = mib
        self.x, self.movers, self.readings = None, {}, {}

    def __enter__(self) -> BandwidthProbe:
        n = max(1, self.mib * 2**20 // 4 // len(jax.local_devices()))
        n -= n % 4096 if n > 4096 else 0
        self.x = x = _over_devices((n,))
        self.movers = {"read": (jax.jit(jnp.sum), 1)}
        if x.sharding.mesh.devices.flat[0].platform != "cpu":
            self.movers["copy"] = (jax.jit(lambda a: a + 1), 2)
        else:
            hugepages.collapse(x)
            if n % 4096 == 0 and cpu.available():
                P = jax.sharding.PartitionSpec

                def read(a):  # [1, n] on one device
                    return cpu.matmul_f32(jnp.ones((1, n // 4096), jnp.float32),
                                          a.reshape(n // 4096, 4096))

                self.movers["kernel_read"] = (jax.jit(jax.shard_map(
                    read, mesh=x.sharding.mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False)), 1)
        return self

    def __exit__(self, *exc) -> None:
        self.x, self.movers = None, {}
        gc.collect()

    def __call__(self) -> float:
        self.readings = {name: passes * self.x.nbytes / _best_of(f, self.x) / 1e9
                         for name, (f, passes) in self.movers.items()}
        return max(self.readings.values())


def peak_gflops(m: int, dtype=jnp.float32) -> float:
    """A [m, m] @ [m, m] matmul of random `dtype` numbers on every local device at once (the
    activations' dtype: bfloat16 runs on other units than float32)."""
    x = _over_devices((m, m), dtype, random=True)
    seconds = _best_of(jax.jit(lambda a: jnp.einsum("dij,djk->dik", a, a)), x, reps=3)
    return 2 * x.shape[0] * m**3 / seconds / 1e9


def peak_rss_gib() -> float:
    """This process's peak resident memory since the last reset_peak_rss (Linux), else ever."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024 / GiB
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB  # Linux: KiB


def reset_peak_rss() -> None:
    """Peak resident memory counted from now (Linux 4.0 on; elsewhere nothing changes)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# --- the workload -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Workload:
    batch_sizes: tuple[int, ...]
    prompt_lens: tuple[int, ...]
    new_tokens: int
    reps: int = 3
    seed: int = 1234

    def check(self, model: Model) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise BenchError(f"batch sizes {self.batch_sizes}: give one or more, each at least 1")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise BenchError(f"prompt lengths {self.prompt_lens}: give one or more, each at least 1")
        if self.new_tokens < 2 or self.reps < 1:
            raise BenchError(f"new_tokens={self.new_tokens}, reps={self.reps}: decode speed needs "
                             "new_tokens >= 2 and reps >= 1")
        longest = max(self.prompt_lens) + self.new_tokens
        if longest > model.config.max_position:
            raise BenchError(f"prompt_len {max(self.prompt_lens)} + new_tokens {self.new_tokens} = "
                             f"{longest} exceeds the model's {model.config.max_position} positions")

    def prompts(self, prompt_len: int, vocab: int) -> np.ndarray:
        """[max batch, prompt_len] seeded ids; batch B measures the first B rows."""
        rng = np.random.default_rng((self.seed, prompt_len))
        return rng.integers(0, vocab, size=(max(self.batch_sizes), prompt_len))


def tool_config(tool: str, args: Sequence[str], c):
    """A benchmarks/ tool's config `c` (its --config flag), after absl's leftover `args` (the
    program name alone, else an error naming them), and with no --config an error: on one CPU
    device (mesh.num_cpu_devices = mesh.data = 1) unless the command line sets either. The tools
    measure the one-device kernels, and a batch of 1 over the configs' eight simulated devices
    runs several times slower."""
    c = read_config(list(args), c, tool)
    given = {a.split("=")[0].removeprefix("--config.") for a in sys.argv[1:]}
    if not {"mesh.num_cpu_devices", "mesh.data"} & given:
        c.mesh.num_cpu_devices, c.mesh.data = 1, 1
    return c


def random_model(s: Settings, seed: int = 0) -> tuple[store.Metadata, Rules, Any]:
    """checkpoint.model's weights drawn at random straight into their shards on the devices, then
    made ready as restored ones are (Model.prepare): (metadata without a tokenizer, rules, params).
    Speed does not depend on the values, and nothing is read or sent."""
    meta, rules, draw = random_weights(s, seed)
    return meta, rules, draw()


def random_weights(s: Settings, seed: int = 0) -> tuple[store.Metadata, Rules, Callable[[], Any]]:
    """random_model's (metadata, rules, a function that draws the weights)."""
    if not s.checkpoint_model:
        raise BenchError("--random_weights needs checkpoint.model (family:preset) to size the weights")
    try:
        model = Model.named(s.checkpoint_model)
    except ValueError as e:
        raise BenchError(f"checkpoint.model: {e}") from e
    rules = Rules.make(make_mesh(s.mesh), s.rules)
    decl = model.declare()
    check_divisible(decl, rules)
    meta = store.Metadata(model, {}, source=f"random:{s.checkpoint_model}:{seed}")
    return meta, rules, lambda: model.prepare(
        weights.init(decl, jax.random.key(seed), rules, jnp.dtype(s.policy.params)), rules, s.policy)


def make_engine(s: Settings, model: Model, params, rules: Rules, batch: int,
                prompt_lens: Sequence[int], new_tokens: int) -> Engine:
    """An engine of `batch` rows for these prompt lengths and new_tokens, its pool holding every
    row at its longest."""
    g = s.generation
    return Engine(model, params, rules, s.policy, batch, max(prompt_lens), new_tokens, g.page_size,
                  steps_per_dispatch=g.steps_per_dispatch, chunk=g.chunk_tokens)


def greedy_requests(prompts: np.ndarray, new_tokens: int, s: Settings) -> list[Request]:
    smp = s.sampling
    return [Request(tuple(int(t) for t in row), new_tokens, smp.temperature, smp.top_k, smp.top_p,
                    smp.seed + i) for i, row in enumerate(prompts)]


def _timed(engine: Engine, requests: list[Request], n: int
           ) -> tuple[float, list[Completion], Stats]:
    out: list[Completion] = [None] * len(requests)

    def done(ended) -> None:
        for i, samples in ended:
            out[i] = samples[0]

    t0 = time.perf_counter()
    stats = Scheduler(engine, [dataclasses.replace(r, max_tokens=n) for r in requests]).run(done)
    seconds = time.perf_counter() - t0
    got = sum(len(c.token_ids) for c in out)
    if got != len(requests) * n:
        raise BenchError(f"batch {len(requests)}: generated {got} tokens, expected "
                         f"{len(requests)} * {n}; a row stopped early")
    return seconds, out, stats


def decode_memory(engine) -> dict:
    """The compiled decode step's buffers, per device, from XLA's memory analysis, beside the KV
    cache it updates in place: temporaries as large as a layer's cache mean XLA copies it."""
    m = engine.lower()[f"decode_{engine.layout.steps}"].compile().memory_analysis()
    cache = jax.tree.leaves(engine.cache)
    return {"decode_temp_bytes": m.temp_size_in_bytes, "decode_argument_bytes": m.argument_size_in_bytes,
            "decode_alias_bytes": m.alias_size_in_bytes,
            "kv_cache_bytes": sum(x.addressable_shards[0].data.nbytes for x in cache)}


def measure(s: Settings, model: Model, params, rules: Rules, w: Workload,
            probe_mib: int = 0, memory: bool = False) -> list[dict]:
    """Timings and roofline counts per (batch size, prompt length); mbu/mfu are filled by `rate`.
    With memory, also the decode step's buffers (decode_memory).

    With probe_mib, the read bandwidth (BandwidthProbe) is measured before each timed repetition
    and after the last, and the record's is their median: a machine whose bandwidth drifts by a
    half from one minute to the next then rates each decode against the bandwidth of its own
    minutes. A record's peak memory is its engine's, from its making through the warm-ups of
    every prompt length (the probe's array comes after)."""
    w.check(model)
    p_size = jnp.dtype(s.policy.params).itemsize
    head_dim = model.module.cache_spec(model.config)[2]
    kv_size = PagedCache.slot_bytes(s.policy.kv_cache, head_dim) / head_dim  # a k or v element's
    prompts = {P: w.prompts(P, model.config.vocab_size) for P in w.prompt_lens}
    N, records = w.new_tokens, []
    for B in w.batch_sizes:
        gc.collect()
        reset_peak_rss()
        engine = make_engine(s, model, params, rules, B, w.prompt_lens, N)
        requests = {P: greedy_requests(prompts[P][:B], N, s) for P in w.prompt_lens}
        warmups = {}
        for P in w.prompt_lens:
            t0 = time.perf_counter()
            _timed(engine, requests[P], 1)
            _timed(engine, requests[P], N)
            warmups[P] = time.perf_counter() - t0
        rss = peak_rss_gib()
        buffers = decode_memory(engine) if memory else {}
        for P in w.prompt_lens:
            requests_p, warmup = requests[P], warmups[P]
            load_before = os.getloadavg()[0]
            t1s, tns, ttfts, decodes, bandwidths, readings = [], [], [], [], [], []
            with BandwidthProbe(probe_mib) if probe_mib else contextlib.nullcontext() as probe:
                for _ in range(w.reps):
                    if probe:
                        bandwidths.append(probe())
                        readings.append(probe.readings)
                    t1s.append(_timed(engine, requests_p, 1)[0])
                    seconds, out, stats = _timed(engine, requests_p, N)
                    tns.append(seconds)
                    ttfts.append(out[0].ttft_s)
                    decodes.append(stats.decode_s / stats.decode_steps * (N - 1))
                if probe:
                    bandwidths.append(probe())
                    readings.append(probe.readings)
            t1, tn = statistics.median(t1s), statistics.median(tns)
            decode = max(statistics.median(decodes), 1e-9)
            cost = decode_cost(model, B, P, N, p_size, kv_size, s.policy.quantize,
                               engine.greedy_screen_bytes)
            records.append({
                "batch_size": B, "rows": engine.layout.batch_size, "prompt_len": P,
                "new_tokens": N, "steps_per_dispatch": engine.layout.steps, "reps": w.reps,
                "prefill_s": t1, "ttft_s": statistics.median(ttfts),
                "total_s": tn, "decode_s": decode, "decode_step_s": decode / (N - 1),
                "decode_tokens_per_s": B * (N - 1) / decode, "e2e_tokens_per_s": B * N / tn,
                "generated_tokens": sum(len(c.token_ids) for c in out),
                "compile_s": max(0.0, warmup - t1 - tn), "warmup_s": warmup,
                "bytes_per_step": cost.bytes, "weight_bytes_per_step": cost.weight_bytes,
                "kv_bytes_per_step": cost.kv_bytes, "flops_per_step": cost.flops,
                "prefill_flops": prefill_flops(model, B, P),
                "peak_rss_gib": rss, "prefill_all_s": t1s, "total_all_s": tns,
                "bandwidth_gbps": statistics.median(bandwidths) if bandwidths else None,
                "bandwidth_all_gbps": bandwidths, "bandwidth_readings_gbps": readings,
                "decode_all_s": decodes, "huge_page_bytes": engine.huge_pages[0],
                "screen_bytes": engine.greedy_screen_bytes,
                "loadavg_before_after": [load_before, os.getloadavg()[0]], **buffers,
            })
        del engine
        gc.collect()
    return records


def rate(records: list[dict], bandwidth_gbps: float, gflops: float) -> None:
    """MBU and MFU of each record's decode step, and MFU of its prefill (prefill_flops over
    prefill_s: the wall time of a 1-token generation, the host's share included), against the
    machine's figures: the record's own
    measured bandwidth (measure's probe), else `bandwidth_gbps`. With the probe, each timed
    repetition's decode is rated against the mean of the two measurements around it (mbu_all) and
    the record's MBU is their median: the bandwidth can change between repetitions, and a median
    step against a median bandwidth would pair a decode with another minute's bandwidth."""
    for r in records:
        bandwidth = r.get("bandwidth_gbps") or bandwidth_gbps
        probes, decodes = r.get("bandwidth_all_gbps") or [], r.get("decode_all_s") or []
        steps = r["new_tokens"] - 1
        per_rep = [r["bytes_per_step"] / (d / steps) / ((a + b) / 2 * 1e9)
                   for d, a, b in zip(decodes, probes, probes[1:])]
        r.update(bandwidth_gbps=bandwidth, peak_gflops=gflops, mbu_all=per_rep,
                 mbu=(statistics.median(per_rep) if per_rep and len(probes) == len(decodes) + 1
                      else r["bytes_per_step"] / r["decode_step_s"] / (bandwidth * 1e9)),
                 mfu=r["flops_per_step"] / r["decode_step_s"] / (gflops * 1e9),
                 prefill_mfu=r["prefill_flops"] / r["prefill_s"] / (gflops * 1e9))


def describe_run(s: Settings, model: Model, rules: Rules) -> dict:
    """What a record was measured with, so runs can be compared."""
    return {
        "model": s.checkpoint_model or model.family, "checkpoint": s.checkpoint_path,
        "precision": dataclasses.asdict(s.policy.on(rules)),
        "sampling": dataclasses.asdict(s.sampling),
        "mesh": dict(rules.mesh.shape), "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
    }


def table(records: list[dict]) -> str:
    head = (f"{'B':>4} {'rows':>4} {'P':>5} {'N':>5} {'compile_s':>9} {'prefill_ms':>10} "
            f"{'ttft_ms':>8} {'step_ms':>8} {'decode_tok/s':>12} {'MB/step':>8} {'MBU':>6} "
            f"{'MFU':>6} {'pf_MFU':>6} {'rss_GiB':>7}")
    lines = [head]
    for r in records:
        lines.append(
            f"{r['batch_size']:>4} {r['rows']:>4} {r['prompt_len']:>5} {r['new_tokens']:>5} "
            f"{r['compile_s']:>9.2f} {1e3 * r['prefill_s']:>10.1f} {1e3 * r['ttft_s']:>8.1f} "
            f"{1e3 * r['decode_step_s']:>8.2f} {r['decode_tokens_per_s']:>12.1f} "
            f"{r['bytes_per_step'] / 1e6:>8.1f} {100 * r['mbu']:>5.1f}% {100 * r['mfu']:>5.1f}% "
            f"{100 * r['prefill_mfu']:>5.1f}% {r['peak_rss_gib']:>7.2f}")
    return "\n".join(lines)


# --- the command --------------------------------------------------------------------------------

def run_job(s: Settings, requests: str, loaded=None) -> dict:
    """Job mode: `requests` through runner.main's whole job (parsing, scheduling, generation,
    results written to a throwaway file) on the config's own engine settings; its figures.
    `loaded`: the model already on the devices (random_model), whose requests give token ids."""
    with tempfile.TemporaryDirectory() as d:
        summary = job.answer(dataclasses.replace(s, input=requests, output=os.path.join(d, "out.jsonl")),
                             loaded)
    return summary.record()


def job_table(r: dict) -> str:
    return (f"{r['requests']} requests ({r['errors']} errors): {r['prompt_tokens']} prompt + "
            f"{r['completion_tokens']} completion tokens in {r['generate_s']:.1f} s "
            f"({r['process_s']:.1f} s since start): {r['tokens_per_s']:.1f} completion tokens/s, "
            f"rows {100 * r['utilisation']:.1f}% used, time to first token "
            f"{r['ttft_median_s']:.3f} / {r['ttft_p99_s']:.3f} s, latency {r['latency_median_s']:.2f} / "
            f"{r['latency_p99_s']:.2f} s (median / p99)")


def _ints(values: Sequence[str], flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError as e:
        raise BenchError(f"--{flag}={','.join(values)}: give comma-separated integers") from e


def main(argv: list[str]) -> None:
    logging.set_verbosity(logging.WARNING)
    config = read_config(argv, _CONFIG.value, "podrun bench")
    started = time.perf_counter()
    config_args = [a for a in sys.argv[1:] if a.startswith("--config")]
    try:
        s = from_config(config)
        setup_devices(s)
        if _REQUESTS.value:
            record = run_job(s, _REQUESTS.value, random_model(s) if _RANDOM.value else None)
            record.update(model=s.checkpoint_model, checkpoint=s.checkpoint_path,
                          precision=dataclasses.asdict(s.policy), devices=jax.device_count(),
                          platform=jax.devices()[0].platform, requests_file=_REQUESTS.value,
                          batch_size=s.generation.batch_size,
                          process_s=time.perf_counter() - started, random_weights=_RANDOM.value,
                          config=config_args)
            if jax.process_index() == 0:
                print(job_table(record))
                _write(record)
            return
        work = Workload(_ints(_BATCH_SIZES.value, "batch_sizes"),
                        _ints(_PROMPT_LENS.value, "prompt_lens") or (_PROMPT_LEN.value,),
                        _NEW_TOKENS.value, _REPS.value, _SEED.value)
        meta, rules, params = random_model(s) if _RANDOM.value else load_model(s)
        model = meta.model
        run = describe_run(s, model, rules)
        log.info(f"bench {run['model']} on {run['devices']} {run['platform']} devices, mesh "
                 f"{run['mesh']}, precision {s.policy.params}/{s.policy.kv_cache}: batches "
                 f"{work.batch_sizes}, prompts {work.prompt_lens}, {work.new_tokens} new tokens, "
                 f"{work.reps} reps")
        records = measure(s, model, params, rules, work, 0 if _BANDWIDTH.value else _PROBE_MIB.value,
                          _MEMORY.value)
        del params
        gc.collect()
        gflops = _PEAK.value or peak_gflops(_PROBE_MATMUL.value, s.policy.dtype)
    except (*USER_ERRORS, BenchError) as e:
        sys.exit(f"podrun bench: error: {e}")
    rate(records, _BANDWIDTH.value, gflops)
    for r in records:
        r.update(run, config=config_args, random_weights=_RANDOM.value,
                 bandwidth_measured=not _BANDWIDTH.value,
                 peak_gflops_measured=not _PEAK.value)
    if jax.process_index() == 0:
        print(f"{run['model']}: {run['devices']} {run['platform']} devices, mesh {run['mesh']}, "
              f"precision {run['precision']}, {records[0]['steps_per_dispatch']} steps per dispatch")
        measured = [g for r in records for g in r["bandwidth_all_gbps"]]
        bandwidth = (f"{min(measured):.1f}-{max(measured):.1f} GB/s measured beside the decodes"
                     if measured else f"{_BANDWIDTH.value:.1f} GB/s given")
        print(f"machine: read bandwidth {bandwidth}, peak {gflops:.0f} GFLOP/s "
              f"({'measured' if not _PEAK.value else 'given'}); load average {os.getloadavg()[0]:.2f}; "
              f"weights and cache on 2 MiB pages: {records[0]['huge_page_bytes'] / 2**20:.0f} MiB")
        print(table(records))
        _write(records)


def _write(records) -> None:
    """--output: the records as JSON, written whole or not at all."""
    if _OUTPUT.value:
        tmp = _OUTPUT.value + ".tmp"
        with open(tmp, "w") as f:
            json.dump(records, f, indent=1)
        os.replace(tmp, _OUTPUT.value)
        log.info(f"wrote the records to {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
