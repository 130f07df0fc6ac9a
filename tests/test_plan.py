"""runner.tools.plan: the job simulated through the real scheduler takes the real run's decisions,
the completion-length assumptions, requests that cannot run reported, and the command's table."""

import json
import re

import numpy as np
import pytest

from models.policy import Policy
from runner.engine import Engine, Request, Scheduler
from runner.tools.simulate import Costs, lengths_from, read_results, simulate
from tests.conftest import rules_for
from tests.reference import VOCAB, tiny_hf, to_podrun


class Zero(Costs):
    def call(self, p, contexts, chunk_at):
        return 0.0


@pytest.fixture(scope="module")
def llama():
    return tiny_hf("llama", seed=3)


def engine_of(m, **kw) -> Engine:
    rules = rules_for("1dev")
    model, params = to_podrun(m, rules)
    args = {"batch_size": 4, "max_prompt_len": 48, "max_new_tokens": 20, "page_size": 4,
            "steps_per_dispatch": 4, "chunk": 16, "pages": 22}
    args.update(kw)
    return Engine(model, params, rules, Policy(), **args)


@pytest.mark.parametrize("longest_first", [False, True])
def test_the_simulated_schedule_is_the_real_runs(llama, longest_first):
    """Nine sampled requests (prompts of 2 to 44 tokens, some sharing a prefix, stop ids that end
    some early) on a real engine whose pool is small enough to preempt: fed the real completions'
    lengths, the stand-in makes the scheduler call the same programs in the same order, and every
    count of the schedule (steps, rows used, pages, preemptions) is the real run's."""
    rng = np.random.RandomState(7)
    shared = tuple(int(t) for t in rng.randint(0, VOCAB, 20))
    prompts = [tuple(int(t) for t in rng.randint(0, VOCAB, n)) for n in (5, 23, 2, 44, 11, 17, 30)]
    prompts += [shared + prompts[0], shared + prompts[2]]
    requests = [Request(p, int(n), temperature=1.0, seed=100 + i)
                for i, (p, n) in enumerate(zip(prompts, (20, 9, 20, 14, 20, 6, 20, 20, 12)))]
    stops = tuple(range(0, VOCAB, 16))  # 8 of 128 ids: some samples end well before max_tokens
    engine = engine_of(llama)
    called, real = [], engine.call

    def recording(step, *args):
        out = real(step, *args)
        L = engine.layout
        called.append(L.program(step.tokens.shape[1] - L.rows_per_group, args[1], args[2],
                                args[3] is not None, args[4]).name)
        return out

    engine.call = recording
    got = {}
    stats = Scheduler(engine, requests, stops, longest_first=longest_first).run(
        lambda ended: got.update((i, [len(c.token_ids) for c in cs]) for i, cs in ended))
    lengths = [got[i] for i in range(len(requests))]
    assert stats.preemptions > 0 and any(n < r.max_tokens for [n], r in zip(lengths, requests))

    sim = simulate(engine_of(llama).layout, requests, lengths, Zero(), longest_first)
    assert sim.calls == called
    for field in ("inserts", "decode_calls", "decode_steps", "row_steps", "prefill_row_steps",
                  "prompt_tokens", "prompt_tokens_computed", "completion_tokens", "pages_peak",
                  "pages_mean", "rows_peak", "rows_mean", "preemptions"):
        assert getattr(sim.stats, field) == getattr(stats, field), field
    assert sim.completion_tokens == sum(sum(ls) for ls in lengths)


@pytest.mark.parametrize("head", [0.0, 3.0])
def test_the_clock_adds_each_calls_cost_and_compile_waits(llama, head):
    """The simulated time is the calls' costs (here 1 s a mixed step, 0.1 s a decode step),
    plus a wait for a program not compiled yet, plus the scheduler's host time. The programs
    begin to compile `head` seconds before the scheduler starts (while the weights load)."""

    class Fixed(Costs):
        def call(self, p, contexts, chunk_at):
            return 1.0 if p.chunk else 0.1 * len(contexts)

        def compile(self, p):
            return 5.0 if p.chunk else 0.0

    requests = [Request((1, 2, 3), 6), Request((4, 5), 6)]
    out = simulate(engine_of(llama).layout, requests, [[6], [2]], Fixed(), False, head)
    mixed = sum(n.startswith("mixed") for n in out.calls)
    steps = out.stats.decode_steps - out.stats.inserts  # decode calls' steps
    assert out.device_s == pytest.approx(mixed + 0.1 * steps)
    # the first call waits for what is left of mixed_16's compilation, less the host work it
    # overlapped
    wait = 5.0 - head
    assert out.compile_wait_s == pytest.approx(wait, abs=0.05) and out.compile_wait_s <= wait
    assert out.generate_s == pytest.approx(out.device_s + out.compile_wait_s + out.host_s)
    assert 0 <= out.host_s < 1 and wait + 1 <= out.first_result_s <= out.generate_s


def test_completion_lengths_follow_the_assumption(tmp_path):
    requests = [Request((1,), m, n=k) for m, k in ((10, 1), (300, 1), (50, 2), (5, 1))]
    ids = ["a", "b", "c", "d"]
    assert lengths_from(requests, ids, "max_tokens") == [[10], [300], [50, 50], [5]]
    assert lengths_from(requests, ids, "mean", mean=40) == [[10], [40], [40, 40], [5]]
    rows = [{"id": "a", "token_ids": list(range(7)), "usage": {"completion_tokens": 7}},
            {"id": "b", "error": {"message": "bad"}},
            {"id": "x", "choices": [{"token_ids": [1] * 30}, {"token_ids": [1] * 90}],
             "usage": {"completion_tokens": 120}},
            {"custom_id": "c", "response": {"body": {"usage": {"completion_tokens": 44}}}}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = read_results(str(path))
    assert results == {"a": [7], "x": [30, 90], "c": [44]}
    got = lengths_from(requests, ids, "results", results=results)
    assert got[0] == [7] and got[2] == [44, 44]  # the file's own, for each sample
    assert got[1][0] in (7, 30, 44, 90) and got[3] == [5]  # drawn from the file, capped
    assert lengths_from(requests, ids, "results", results=results) == got  # deterministic
    with pytest.raises(ValueError, match="no completion lengths"):
        lengths_from(requests, ids, "results", results={})


def test_requests_that_cannot_run_are_reported(llama):
    from runner.tools.plan import never_admitted

    engine = engine_of(llama)
    bad = never_admitted(engine.layout, [Request((1,) * 10, 5), Request((1,) * 60, 5), Request((1,), 99)])
    assert len(bad) == 2 and bad[0].startswith("request 1:") and bad[1].startswith("request 2:")


def test_the_command_prints_a_table_of_alternatives(tmp_path):
    """A file of token ids on a random llama:tiny (no checkpoint): the refused request comes
    first, then the programs and one row per batch size, and the schedule's completion tokens
    are what --completion_tokens and the max_tokens give."""
    from tests.test_end_to_end import podrun, write_jsonl

    rng = np.random.RandomState(0)
    max_tokens = [4, 20, 9, 30, 5, 12]
    rows = [{"id": i, "prompt_token_ids": rng.randint(1, 100, n).tolist(), "max_tokens": m}
            for i, (n, m) in enumerate(zip([3, 17, 9, 30, 5, 12], max_tokens))]
    rows.append({"id": "too_long", "prompt_token_ids": [1, 2], "max_tokens": 999})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    p = podrun("runner.tools.plan", "--config=configs/cpu.py:/no/such/checkpoint",
               "--config.checkpoint.model=llama:tiny", "--config.mesh.num_cpu_devices=1",
               "--config.mesh.data=1", f"--config.io.input={inp}", "--config.generation.page_size=4",
               "--config.generation.batch_size=2", "--config.generation.max_prompt_len=32",
               "--config.generation.max_new_tokens=32", f"--config.compilation_cache.dir={tmp_path / 'xla'}",
               "--completion_tokens=10", "--compare=generation.batch_size=1,4", "--reps=1",
               "--price_per_chip_hour=3.5", f"--json={tmp_path / 'plan.json'}")
    out = p.stdout
    assert "1 requests the job refuses" in out and "too_long" in out
    assert out.index("refuses") < out.index("programs")
    assert "decode_8" in out and "mixed_16" in out
    want = sum(min(10, m) for m in max_tokens)
    assert f"{want} completion tokens" in out
    _, rows = table(out)
    assert [row["deployment"] for row in rows] == ["config", "batch_size=1", "batch_size=4"]
    records = json.loads((tmp_path / "plan.json").read_text())
    assert [r["label"] for r in records] == ["config", "batch_size=1", "batch_size=4"]
    for row, r in zip(rows, records):
        wall, hours, cost = (float(row[k]) for k in ("wall s", "chip-hours", "cost"))
        assert row["wall range"] == "-" and r["wall_s_range"] is None  # lengths assumed, not sampled
        assert wall > 0 and cost == pytest.approx(hours * 3.5, abs=0.01)
        assert r["wall_s"] == pytest.approx(wall, abs=0.05) and r["completion_tokens"] == want


def test_a_predicted_step_is_the_slower_of_its_bytes_and_its_flops():
    """v5e (819 GB/s, 197 TFLOP/s): a decode step reading 819 MB of weights and 2 rows' KV
    (1 kB a position; a windowed layer's 0.5 kB, at most 128 positions) is bound by bandwidth
    (not XLA's bytes accessed); a mixed step of 197 TFLOP by its flops; each call 100 us more."""
    from runner.engine.engine import Program
    from runner.tools.compile import Compiled
    from runner.tools.plan import Predicted

    compiled = {"decode_8": Compiled("decode_8", 0, 0, 0, 0, flops=1e9, bytes_accessed=5e9),
                "mixed_64": Compiled("mixed_64", 0, 0, 0, 0, flops=197e12, bytes_accessed=5e9)}
    costs = Predicted("v5e", compiled, 819e6, 1000.0, 500.0, window=128)
    ctx = np.array([100, 1000])
    kv = 1000.0 * 1100 + 500.0 * (100 + 128)
    want = 1e-4 + 2 * (819e6 + kv) / 819e9
    assert costs.call(Program(0, 8), [ctx, ctx + 1], 0) == pytest.approx(
        1e-4 + (819e6 + kv) / 819e9 + (819e6 + kv + 1000.0 * 2 + 500.0 * 1) / 819e9)
    assert costs.call(Program(0, 8), [ctx, ctx], 0) == pytest.approx(want)
    assert costs.call(Program(16, 1), [ctx], 0) == pytest.approx(1e-4 + 1.0)  # mixed_64's, flops-bound


def test_a_deployment_that_does_not_fit_is_reported_before_any_cost(tmp_path):
    """Weights and pool over mesh.device_memory_gib: the plan says so, with the memory report,
    and builds, compiles and simulates nothing."""
    from configs.cpu import get_config
    from runner.settings import from_config
    from runner.tools.plan import plan_one, report

    c = get_config("/no/such/checkpoint")
    c.checkpoint.model = "llama:tiny"
    c.mesh.update(num_cpu_devices=1, data=1, device_memory_gib=1e-6)
    c.generation.update(page_size=4, batch_size=2, max_prompt_len=32, max_new_tokens=8)
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 4}) + "\n")
    c.io.input = str(path)
    p, job = plan_one(from_config(c), "config", "measure", None, None, ("max_tokens", 0, None), 1, {})
    assert p.outcome is None and "more than" in p.problems[0] and "DOES NOT FIT" in p.problems[0]
    assert len(job.requests) == 1 and "engine" not in p.startup
    out = report([p], job, "max_tokens", 0.0)
    assert "config: DOES NOT RUN" in out and "does not run" in out.splitlines()[-1]


def test_a_gpu_deployment_is_predicted_on_this_cpu(tmp_path):
    """--gpu=h100 plans a GPU deployment with no GPU here: its programs are lowered on this CPU for
    the GPU's kernels, so a prompt of 150 tokens is one mixed_256 (a step costs a GPU hundreds of
    tokens' flops: the chunk is padded), where the CPU's own plan splits it into 16, 16, 64, 64;
    each step costs the slower of its bytes at the H100's bandwidth and its flops at its peak."""
    from tests.test_end_to_end import podrun, write_jsonl

    rows = [{"id": i, "prompt_token_ids": list(range(1 + i, 151 + i)), "max_tokens": 20} for i in range(3)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)  # no prefix shared: each prompt computed whole
    common = ("--config.checkpoint.model=llama:tiny",
              "--config.checkpoint.path=/no/such/checkpoint", f"--config.io.input={inp}",
              "--config.generation.batch_size=4", "--config.generation.max_prompt_len=256",
              "--config.generation.max_new_tokens=32", "--config.generation.kv_cache_gib=0",
              f"--config.compilation_cache.dir={tmp_path / 'xla'}")
    gpu = podrun("runner.tools.plan", "--config=configs/llama3_h100.py", *common, "--gpu=h100").stdout
    assert "predicted for h100 (3350 GB/s HBM, 989 TFLOP/s" in gpu
    programs = gpu[gpu.index("programs"):gpu.index("host (scheduler)")]
    assert "mixed_256" in programs and "mixed_16 " not in programs and "mixed_64 " not in programs
    cpu = podrun("runner.tools.plan", "--config=configs/cpu.py:/no/such/checkpoint", *common,
                 "--config.mesh.data=1", "--config.mesh.num_cpu_devices=1").stdout
    programs = cpu[cpu.index("programs"):cpu.index("host (scheduler)")]
    assert "measured here" in cpu and "mixed_16 " in programs and "mixed_64 " in programs


def test_a_pilots_interval_of_the_jobs_mean_length_covers_it_as_often_as_it_says():
    """Spread's 95% interval of the mean length of a job's samples the pilot does not hold: on
    4,000 synthetic jobs (a pilot of 16, 112 other samples, lengths drawn from one normal
    distribution), the others' mean falls inside it 95% of the time, and its ends are scipy's
    t interval of a future mean of 112 draws."""
    from scipy import stats

    from runner.tools.simulate import Spread

    rng = np.random.default_rng(0)
    n, u, trials = 16, 112, 4000
    pilots, others = rng.normal(100, 30, (trials, n)), rng.normal(100, 30, (trials, u))
    inside = 0
    for pilot, rest in zip(pilots, others):
        sp = Spread(n + u, u, n, float(pilot.mean()), float(pilot.std(ddof=1)))
        inside += sp.low <= rest.mean() <= sp.high
    assert 0.935 < inside / trials < 0.965
    want = stats.t.interval(0.95, n - 1, loc=pilot.mean(), scale=pilot.std(ddof=1) * np.sqrt(1 / n + 1 / u))
    assert (sp.low, sp.high) == pytest.approx(want, rel=1e-9)


def test_a_spread_counts_the_samples_the_pilot_holds_and_the_pilot_that_would_narrow_it():
    """Spread.of: the pilot's lengths (every sample of its results), the job's samples and those
    not in the pilot; pilot_for: the smallest pilot of the job's own samples whose interval of the
    job's mean length, (N - n) / N x the others' (scipy's t interval), shrinks a wall range of
    +/- r in proportion to +/-10%, found here by trying every size."""
    from scipy import stats

    from runner.tools.simulate import Spread

    rng = np.random.default_rng(1)
    requests = [Request((1,), 256, n=1 + (i % 3 == 0)) for i in range(200)]
    ids = list(range(200))
    results = {i: [int(x) for x in rng.integers(8, 256, r.n)] for i, r in zip(ids[:20], requests)}
    results["elsewhere"] = [40, 90]  # a pilot request the job does not have: its lengths count
    pool = [x for ls in results.values() for x in ls]
    sp = Spread.of(requests, ids, results)
    N = sum(r.n for r in requests)
    assert (sp.samples, sp.unknown, sp.pilot) == (N, N - sum(len(results[i]) for i in ids[:20]), len(pool))
    assert (sp.mean, sp.sd) == pytest.approx((np.mean(pool), np.std(pool, ddof=1)))

    def job_half(n, unknown):  # the job's mean: the others' interval, weighted by their share
        lo, hi = stats.t.interval(0.95, n - 1, scale=sp.sd * np.sqrt(1 / n + 1 / unknown))
        return unknown / N * (hi - lo) / 2

    now = job_half(sp.pilot, sp.unknown)
    for r in (0.05, 0.25, 0.6):
        want = next((n for n in range(2, N) if r * job_half(n, N - n) / now <= 0.10), N) if r > 0.10 else 0
        assert sp.pilot_for(r) == want, r
    assert Spread(N, 0, 10, 50.0, 9.0).half == 0 and Spread(N, 5, 1, 50.0, 0.0).half == np.inf


def test_drawn_lengths_scale_to_a_mean_and_known_ones_stay():
    """lengths_from(drawn_mean=m): the lengths drawn from the pilot (the same draws) scaled to a
    mean of m, then capped by max_tokens; the pilot's own requests keep their lengths."""
    requests = [Request((1,), 300)] * 51
    ids = list(range(51))
    results = {0: [30], 1: [50], 2: [70]}
    drawn = np.array([x for [x] in lengths_from(requests, ids, "results", results=results)[3:]])
    requests[50] = Request((1,), 12)  # its draw is the same; its scaled length is capped
    scaled = lengths_from(requests, ids, "results", results=results, drawn_mean=100.0)
    assert [x for [x] in scaled[:3]] == [30, 50, 70]
    assert [x for [x] in scaled[3:50]] == [round(x * 100 / drawn.mean()) for x in drawn[:-1]]
    assert scaled[50] == [min(12, round(drawn[-1] * 100 / drawn.mean()))]


def table(out: str) -> tuple[list[str], list[dict[str, str]]]:
    """The plan's table read back: its headers, which must stand two spaces or more apart (one
    may hold a space), and each row's cells by header, each cell right-aligned under its header
    (the deployment's left-aligned)."""
    lines = out[out.index("  deployment"):].splitlines()
    spans = [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
    names = [lines[0][a:b] for a, b in spans]
    rows = []
    for line in lines[1:]:
        if not line.startswith("  ") or "does not run" in line:
            break
        cells = [(m.start(), m.end(), m.group()) for m in re.finditer(r"\S+", line)]
        assert len(cells) == len(spans), line
        assert cells[0][0] == spans[0][0] and all(c[1] == s[1] for c, s in zip(cells[1:], spans[1:])), line
        rows.append({name: c[2] for name, c in zip(names, cells)})
    return names, rows


def test_a_pilots_lengths_give_the_wall_time_a_range_in_a_table_whose_columns_stay_apart(tmp_path):
    """--completion_from a pilot of 8 of the job's 30 requests: the table's headers and cells
    stand apart, and the wall time comes with its range at the ends of the pilot's interval of
    the other 22 requests' mean length (scipy's), as the JSON gives it."""
    from scipy import stats

    from tests.test_end_to_end import podrun, write_jsonl

    rng = np.random.RandomState(2)
    rows = [{"id": i, "prompt_token_ids": rng.randint(1, 100, int(n)).tolist(), "max_tokens": 30}
            for i, n in enumerate(rng.randint(3, 30, 30))]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    lengths = [3, 9, 14, 20, 28, 6, 17, 11]
    pilot = write_jsonl(tmp_path / "pilot.jsonl", [{"id": i, "token_ids": [1] * n} for i, n in enumerate(lengths)])
    p = podrun("runner.tools.plan", "--config=configs/cpu.py:/no/such/checkpoint",
               "--config.checkpoint.model=llama:tiny", f"--config.io.input={inp}", "--config.generation.page_size=4",
               "--config.generation.batch_size=2", "--config.generation.max_prompt_len=32",
               "--config.generation.max_new_tokens=32", f"--config.compilation_cache.dir={tmp_path / 'xla'}",
               f"--completion_from={pilot}", "--price_per_chip_hour=2", f"--json={tmp_path / 'plan.json'}")
    names, [row] = table(p.stdout)
    assert names == ["deployment", "wall s", "wall range", "tok/s", "first s", "chip-hours", "cost", "preempt",
                     "rows"]
    [record] = json.loads((tmp_path / "plan.json").read_text())
    lo, hi = record["wall_s_range"]
    assert lo < hi and row["wall range"] == f"{lo:.1f}-{hi:.1f}" and row["wall s"] == f"{record['wall_s']:.1f}"
    low, high = stats.t.interval(0.95, 7, loc=np.mean(lengths),
                                 scale=np.std(lengths, ddof=1) * np.sqrt(1 / 8 + 1 / 22))
    said = re.search(r"wall time ([\d.]+)-([\d.]+) s at the ends of a 95% interval of the mean length of the "
                     r"22 samples not in the pilot, ([\d.]+)-([\d.]+) tokens", p.stdout)
    assert said and [float(x) for x in said.groups()] == pytest.approx(
        [lo, hi, max(1.0, low), high], abs=0.051), p.stdout
    n = record["pilot_for_10pct"]
    assert (f"a pilot of {n} of the job's requests would narrow it to +/-10%" if n else "within +/-10%") in p.stdout
