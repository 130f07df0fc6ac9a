"""`python -m runner.tools.bench`: its records, and its roofline counts against the checkpoints' own arrays."""

import json
import subprocess
import sys

import numpy as np
import pytest

from models.registry import Model
from runner.engine import Completion
from runner.tools import bench
from tests.reference import tiny_hf
from tests.test_end_to_end import ROOT, podrun

BATCHES, PROMPT_LENS, NEW = (1, 3), (8, 12), 4


def independent_cost(m, batch: int, prompt_len: int, new_tokens: int, kv_itemsize: int):
    """(bytes, flops) of one decode step, from the transformers model's own float32 arrays:
    every parameter once, except the untied token embedding (`batch` rows gathered) and the
    experts (min(batch * k, E) of E read, k per token computed)."""
    cfg = m.config
    k, E = getattr(cfg, "num_experts_per_tok", 0), getattr(cfg, "num_local_experts", 1)
    tied = bool(cfg.tie_word_embeddings)
    read = used = 0.0
    for name, p in m.named_parameters():  # a tied lm_head is the embedding, listed once
        a = p.detach().numpy()
        if name == "model.embed_tokens.weight" and not tied:
            read += batch * a.shape[1] * a.itemsize
        elif ".experts." in name:
            read += a.nbytes * min(batch * k, E) / E
            used += a.size * k / E
        else:
            read += a.nbytes
            used += a.size
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    kv = attention = 0.0
    for kind in types:
        window = cfg.sliding_window if kind == "sliding_attention" else None
        steps = [prompt_len + i for i in range(1, new_tokens)]  # step i attends over P + i positions
        seen = np.mean([min(n, window) if window else n for n in steps])
        kv += 2 * batch * seen * kv_heads * head_dim * kv_itemsize
        attention += 4 * batch * heads * head_dim * seen
    return read + kv, 2 * batch * used + attention


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gptoss"])  # untied, tied, top-2 of 8 experts
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_decode_cost_counts_what_a_step_reads_and_computes(kind, batch):
    m = tiny_hf(kind, seed=2)
    model = Model.from_hf_config(m.config.to_dict())
    cost = bench.decode_cost(model, batch, prompt_len=12, new_tokens=6, param_itemsize=4, kv_itemsize=2)
    want_bytes, want_flops = independent_cost(m, batch, 12, 6, kv_itemsize=2)
    assert cost.bytes == pytest.approx(want_bytes, rel=1e-12)
    assert cost.flops == pytest.approx(want_flops, rel=1e-12)
    # greedy through the unembedding's screen: its bytes in place of the [V, D] float32 matrix
    screened = bench.decode_cost(model, batch, prompt_len=12, new_tokens=6, param_itemsize=4,
                                 kv_itemsize=2, screen_bytes=12345)
    unembedding = m.config.vocab_size * m.config.hidden_size * 4
    assert screened.bytes == pytest.approx(want_bytes - unembedding + 12345, rel=1e-12)
    assert screened.flops == cost.flops


def independent_prefill_flops(m, batch: int, prompt_len: int) -> float:
    """A prefill's arithmetic from the transformers model's own parameters: every parameter a token
    uses (top-k of the experts) for every prompt token, except the token embedding (looked up) and
    the unembedding (once per prompt, at its last position); causal attention, each query over
    itself and the keys before it within its layer's window."""
    cfg = m.config
    k, E = getattr(cfg, "num_experts_per_tok", 0), getattr(cfg, "num_local_experts", 1)
    body = 0.0
    for name, p in m.named_parameters():  # a tied lm_head is the embedding, listed once
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        body += p.numel() * (k / E if ".experts." in name else 1)
    head = cfg.vocab_size * cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    attended = 0
    for kind in types:
        window = cfg.sliding_window if kind == "sliding_attention" else None
        attended += sum(min(t + 1, window) if window else t + 1 for t in range(prompt_len))
    return 2 * batch * (prompt_len * body + head) + 4 * batch * heads * head_dim * attended


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gptoss"])  # untied, tied, top-2 of 8 experts
@pytest.mark.parametrize("batch,prompt_len", [(1, 5), (3, 40)])  # inside and past gptoss' window
def test_prefill_flops_count_what_a_prefill_computes(kind, batch, prompt_len):
    m = tiny_hf(kind, seed=2)
    model = Model.from_hf_config(m.config.to_dict())
    assert bench.prefill_flops(model, batch, prompt_len) == pytest.approx(
        independent_prefill_flops(m, batch, prompt_len), rel=1e-12)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    m = tiny_hf("llama", seed=7)
    root = tmp_path_factory.mktemp("bench")
    m.save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    return m, root


def test_bench_writes_a_record_per_batch_and_prompt_len_and_decodes_every_token(llama_ckpt):
    m, root = llama_ckpt
    out = root / "bench.json"
    p = podrun("runner.tools.bench", f"--config=configs/cpu.py:{root / 'ck'}:mesh8",
               f"--config.compilation_cache.dir={root / 'xla'}",
               "--config.generation.stop_token_ids=(0,1,2,3)",  # the bench stops on no id
               f"--batch_sizes={','.join(map(str, BATCHES))}",
               f"--prompt_lens={','.join(map(str, PROMPT_LENS))}", f"--new_tokens={NEW}", "--reps=1",
               "--probe_mib=16", "--probe_matmul=128", f"--output={out}")
    records = json.loads(out.read_text())
    assert sorted((r["batch_size"], r["prompt_len"]) for r in records) == [
        (b, n) for b in BATCHES for n in PROMPT_LENS]
    required = {"batch_size", "prompt_len", "new_tokens", "prefill_s", "ttft_s", "decode_tokens_per_s",
                "mbu", "decode_step_s", "compile_s", "mfu", "bytes_per_step", "bandwidth_gbps",
                "peak_rss_gib", "precision", "steps_per_dispatch", "mesh"}
    for r in records:
        assert required <= set(r), required - set(r)
        assert r["new_tokens"] == NEW and r["rows"] == 8  # 8 simulated devices on the data axis
        assert r["generated_tokens"] == r["batch_size"] * NEW
        assert r["precision"]["params"] == "float32"
        assert r["precision"]["backend"]["product_kernel"] is False  # 8 devices: one-device kernels off
        assert r["bandwidth_gbps"] > 0 and r["peak_rss_gib"] > 0
        # the bandwidth is measured before the one timed repetition and after it
        assert len(r["bandwidth_all_gbps"]) == 2
        assert r["bandwidth_gbps"] == pytest.approx(float(np.median(r["bandwidth_all_gbps"])))
        want_bytes, want_flops = independent_cost(m, r["batch_size"], r["prompt_len"], NEW, 4)
        assert r["bytes_per_step"] == pytest.approx(want_bytes, rel=1e-12)
        # one repetition: its decode against the mean of the two measurements around it
        around = sum(r["bandwidth_all_gbps"]) / 2 * 1e9
        step = r["decode_all_s"][0] / (NEW - 1)
        assert r["mbu_all"] == [pytest.approx(want_bytes / step / around)]
        assert r["mbu"] == pytest.approx(want_bytes / r["decode_step_s"] / (r["bandwidth_gbps"] * 1e9))
        assert r["mfu"] == pytest.approx(want_flops / r["decode_step_s"] / (r["peak_gflops"] * 1e9))
        prefill = independent_prefill_flops(m, r["batch_size"], r["prompt_len"])
        assert r["prefill_mfu"] == pytest.approx(prefill / r["prefill_s"] / (r["peak_gflops"] * 1e9))
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] * (NEW - 1) / r["decode_s"])
        # one rep: the engine's clocks (first tokens, then the rest) lie inside the run's wall time
        assert 0 < r["ttft_s"] and 0 < r["decode_s"] and r["ttft_s"] + r["decode_s"] <= r["total_s"]
    table = p.stdout.splitlines()
    assert len([line for line in table if line.split()[:1] in (["1"], ["3"])]) == len(records)


def test_mbu_rates_each_repetition_against_the_bandwidth_measured_around_it():
    """Three repetitions whose bandwidth changed after the second (probes 30, 30, 50, 50 GB/s):
    each decode is rated against its own minutes, and the record's MBU is their median, where a
    median step against the median probe (40) would rate all three against a bandwidth none saw."""
    steps, nbytes = 127, 450e6
    record = {"new_tokens": steps + 1, "bytes_per_step": nbytes, "flops_per_step": 1e9,
              "prefill_flops": 3e9, "prefill_s": 0.5,
              "bandwidth_all_gbps": [30.0, 30.0, 50.0, 50.0], "bandwidth_gbps": 40.0,
              "decode_all_s": [steps * 0.016, steps * 0.0155, steps * 0.0105]}
    record["decode_step_s"] = float(np.median(record["decode_all_s"])) / steps
    bench.rate([record], 0.0, 100.0)
    want = [nbytes / 0.016 / 30e9, nbytes / 0.0155 / 40e9, nbytes / 0.0105 / 50e9]
    assert record["mbu_all"] == pytest.approx(want)
    assert record["mbu"] == pytest.approx(sorted(want)[1])
    assert record["mfu"] == pytest.approx(1e9 / 0.0155 / 100e9)
    assert record["prefill_mfu"] == pytest.approx(3e9 / 0.5 / 100e9)


def test_a_row_that_stops_early_is_an_error(monkeypatch):
    class Short:  # a scheduler whose second row ends a token early
        def __init__(self, engine, requests):
            self.requests = requests

        def run(self, done):
            done([(i, [Completion([5] * (r.max_tokens - (i == 1)), "stop")])
                  for i, r in enumerate(self.requests)])
            return bench.Stats()

    monkeypatch.setattr(bench, "Scheduler", Short)
    requests = bench.greedy_requests(np.zeros((2, 4), np.int64), 4, _settings())
    with pytest.raises(bench.BenchError, match=r"generated 7 tokens, expected 2 \* 4"):
        bench._timed(None, requests, 4)


def test_bad_workloads_are_refused_in_one_line(llama_ckpt):
    m, root = llama_ckpt
    for args, message in [(("--new_tokens=1",), "new_tokens >= 2"),
                          (("--batch_sizes=1,x",), "--batch_sizes=1,x: give comma-separated integers"),
                          (("--prompt_len=250", "--new_tokens=8"), "exceeds the model's 256 positions")]:
        p = podrun("runner.tools.bench", f"--config=configs/cpu.py:{root / 'ck'}", *args, check=False)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("podrun bench: error:") and message in last, p.stderr[-2000:]


def _settings():
    from configs.cpu import get_config
    from runner.settings import from_config

    return from_config(get_config("/unused"))


def test_job_mode_runs_a_request_file_through_the_whole_engine(tmp_path):
    """--requests: the file through runner.main's job; the record counts what the file asks for
    (prompt tokens, max_tokens each, as no id stops a row of this tokenizer-less model), the
    invalid line as an error, and the decode row-steps cover every token but the first ones."""
    from tests.reference import tiny_hf
    from tests.test_end_to_end import podrun, write_jsonl

    tiny_hf("llama", seed=3).save_pretrained(tmp_path / "hf")
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    rng = np.random.RandomState(0)
    lengths, max_tokens = [3, 17, 9, 30, 5, 12], [4, 20, 1, 9, 16, 7]
    rows = [{"id": i, "prompt_token_ids": rng.randint(1, 100, n).tolist(), "max_tokens": m}
            for i, (n, m) in enumerate(zip(lengths, max_tokens))]
    rows.append({"id": "bad", "prompt_token_ids": [1, 2], "max_tokens": 999})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    podrun("runner.tools.bench", f"--config=configs/cpu.py:{tmp_path / 'ck'}", f"--requests={inp}",
           f"--output={tmp_path / 'job.json'}", "--config.generation.batch_size=2",
           "--config.mesh.num_cpu_devices=1", "--config.mesh.data=1",
           "--config.generation.max_prompt_len=32", "--config.generation.max_new_tokens=24",
           f"--config.compilation_cache.dir={tmp_path / 'xla'}")
    r = json.loads((tmp_path / "job.json").read_text())
    assert (r["requests"], r["errors"], r["generated"]) == (7, 1, 6)
    assert r["prompt_tokens"] == sum(lengths) and r["completion_tokens"] == sum(max_tokens)
    assert r["engine_batch_size"] == 2 and 0 < r["utilisation"] <= 1
    assert r["engine_decode_steps"] * 2 >= sum(max_tokens) - len(max_tokens)
    assert r["ttft_median_s"] <= r["ttft_p99_s"] and r["latency_median_s"] <= r["latency_p99_s"]
    assert r["tokens_per_s"] > 0 and r["process_s"] >= r["generate_s"]


def test_random_weights_need_no_checkpoint_for_shapes_or_jobs(tmp_path):
    """--random_weights: checkpoint.model's weights made on the devices, nothing read (the path
    does not exist). Fixed shapes decode every token; a job of token ids answers each with its
    max_tokens, and a text prompt, which needs the tokenizer no random model has, is its error."""
    from tests.test_end_to_end import podrun, write_jsonl

    common = ["--config=configs/cpu.py:/no/such/checkpoint", "--random_weights",
              "--config.checkpoint.model=llama:tiny", "--config.mesh.num_cpu_devices=1",
              "--config.mesh.data=1", f"--config.compilation_cache.dir={tmp_path / 'xla'}"]
    podrun("runner.tools.bench", *common, "--batch_sizes=2", "--prompt_len=8", "--new_tokens=4", "--reps=1",
           "--probe_mib=16", "--probe_matmul=128", "--memory_analysis",
           f"--output={tmp_path / 'shapes.json'}")
    [r] = json.loads((tmp_path / "shapes.json").read_text())
    assert r["random_weights"] and r["generated_tokens"] == 2 * 4 and r["model"] == "llama:tiny"
    # --memory_analysis: the pool (2 rows of 8 + 4 tokens, 1 page of 16 each: 2 layers x k, v x
    # 2 pages x 2 kv heads x 16 slots x 16 float32) is donated to the decode step and updated in
    # place, so its bytes are aliased
    assert r["kv_cache_bytes"] == 2 * 2 * 2 * 2 * 16 * 16 * 4
    assert r["decode_alias_bytes"] >= r["kv_cache_bytes"] and r["decode_temp_bytes"] >= 0
    rows = [{"id": i, "prompt_token_ids": list(range(1, n + 1)), "max_tokens": m}
            for i, (n, m) in enumerate([(5, 3), (12, 7), (2, 1)])]
    rows.append({"id": "text", "prompt": "hello"})
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    podrun("runner.tools.bench", *common, f"--requests={inp}", f"--output={tmp_path / 'job.json'}",
           "--config.generation.batch_size=2", "--config.generation.max_prompt_len=16",
           "--config.generation.max_new_tokens=8")
    job = json.loads((tmp_path / "job.json").read_text())
    assert (job["requests"], job["errors"], job["generated"]) == (4, 1, 3)
    assert job["completion_tokens"] == 3 + 7 + 1 and job["random_weights"]
    p = subprocess.run([sys.executable, "-m", "runner.tools.bench", "--config=configs/cpu.py:/x",
                        "--random_weights", "--config.mesh.num_cpu_devices=1", "--config.mesh.data=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        "podrun bench: error: --random_weights needs checkpoint.model (family:preset) to size the "
        "weights")
