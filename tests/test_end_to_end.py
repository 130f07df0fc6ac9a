"""`python -m runner.tools.convert` + `python -m runner.main` against transformers, and bad input."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.reference import VOCAB, hf_greedy, tiny_hf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 32


def podrun(*args, check=True):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    if check and p.returncode:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "gptoss"])
def model_dir(request, tmp_path_factory):
    m = tiny_hf(request.param, seed=11)
    root = tmp_path_factory.mktemp(request.param)
    m.save_pretrained(root / "hf", max_shard_size="100KB")  # sharded safetensors + index
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    return m, root


def run_main(root, input_path, output, *overrides, check=True):
    return podrun("runner.main", f"--config=configs/cpu.py:{root / 'ck'}", f"--config.io.input={input_path}",
                  f"--config.io.output={output}", "--config.generation.max_prompt_len=64",
                  f"--config.generation.max_new_tokens={STEPS}", "--config.generation.batch_size=4",
                  f"--config.compilation_cache.dir={root / 'xla'}", *overrides, check=check)


# configs/cpu.py runs one device; the sharded meshes ask for 8 simulated devices.
EIGHT = "--config.mesh.num_cpu_devices=8"


# A sharded mesh with scan over layers and fused projections; and (slow: the same paths as
# test_engine and test_models check in-process, and the other tests here run one device through
# runner.main) one device, and data x model alone.
@pytest.mark.parametrize("mesh", [pytest.param((), marks=pytest.mark.slow),
                                  (EIGHT, "--config.mesh.data=2", "--config.mesh.expert=2", "--config.mesh.model=2",
                                   "--config.programs.scan_layers=true",
                                   "--config.programs.fuse_projections=true"),
                                  pytest.param((EIGHT, "--config.mesh.data=2", "--config.mesh.model=4"),
                                               marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(model_dir, mesh, tmp_path):
    m, root = model_dir
    rng = np.random.RandomState(5)
    prompts = [[int(t) for t in rng.randint(0, VOCAB, n)] for n in (7, 30, 1, 18, 45, 3)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    run_main(root, inp, out, "--config.io.echo_prompt=true", *mesh)
    results = read_jsonl(out)
    assert [r["id"] for r in results] == [f"r{i}" for i in range(len(prompts))]  # input order
    for r, p in zip(results, prompts):
        assert r["prompt_token_ids"] == p
        assert r["token_ids"] == hf_greedy(m, p, STEPS)
        assert r["finish_reason"] == "length"
        assert r["usage"] == {"prompt_tokens": len(p), "completion_tokens": STEPS}
    assert not os.path.exists(str(out) + ".partial")


# GPT-OSS (windows, sinks) and Llama by default, the other two under -m slow
@pytest.mark.parametrize("model_dir", ["gptoss", "llama", *(pytest.param(k, marks=pytest.mark.slow)
                                                             for k in ("qwen2", "gpt2"))], indirect=True)
@pytest.mark.parametrize("mesh", [(EIGHT, "--config.mesh.data=2", "--config.mesh.model=4"),
                                  pytest.param((), marks=pytest.mark.slow),
                                  pytest.param((EIGHT, "--config.mesh.data=2", "--config.mesh.model=4",
                                                "--config.programs.scan_layers=true"),
                                               marks=pytest.mark.slow)])
def test_paged_greedy_through_chunks_and_preemption_matches_transformers(model_dir, mesh, tmp_path):
    """The paged engine with a pool too small for every row at once: prompts chunked 16 tokens a
    step, rows preempted mid-answer and recomputed; the tokens still transformers'. Scanned
    layers too (tests/test_paged.py checks them more cheaply)."""
    m, root = model_dir
    c = m.config
    kv_heads = getattr(c, "num_key_value_heads", None) or getattr(c, "n_head", None)
    layers = getattr(c, "num_hidden_layers", None) or c.n_layer
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // (getattr(c, "num_attention_heads", None) or c.n_head)
    model_shards = 4 if "--config.mesh.model=4" in mesh else 1
    rows = 2 if model_shards == 4 else 4  # a group's: batch 4 over the data axis
    # bytes of a page (4 tokens, float32) of `n` layers on a device
    page = lambda n: 2 * n * -(-kv_heads // model_shards) * 4 * head_dim * 4
    # GPT-OSS: a window of 8 on its sliding layers, whose own pool holds, per row, the window and
    # a chunk of 16 back from the end and two pages more: (8 - 1 + 16) / 4, rounded up, + 2
    windowed = sum(t == "sliding_attention" for t in getattr(c, "layer_types", None) or ())
    window_bytes = rows * 8 * page(windowed)
    # 26 full-layer pages per group (2 rows over data=2, 4 on one device) hold one request of
    # max_prompt_len + max_new_tokens = 96 tokens (24 pages), not every row's 32 tokens after
    # prompts of up to 45
    pages = 26 if model_shards == 4 else 30
    kv_bytes = (pages + 0.5) * page(layers - windowed) + window_bytes
    rng = np.random.RandomState(6)
    prompts = [[int(t) for t in rng.randint(0, VOCAB, n)] for n in (7, 30, 1, 18, 45, 3, 22)]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": p} for i, p in enumerate(prompts)])
    out = tmp_path / "out.jsonl"
    got = run_main(root, inp, out, "--config.generation.page_size=4", "--config.generation.chunk_tokens=16",
                   f"--config.generation.kv_cache_gib={kv_bytes / 2**30!r}", *mesh)
    preempted = int(got.stderr.split(" preemptions")[0].rsplit(" ", 1)[1])
    assert preempted > 0, got.stderr[-2000:]
    for r, p in zip(read_jsonl(out), prompts):
        assert r["token_ids"] == hf_greedy(m, p, STEPS)
        assert r["usage"] == {"prompt_tokens": len(p), "completion_tokens": STEPS}


# The runner's handling of requests does not depend on the model: one model by default, each under
# -m slow.
ONE_MODEL = ["gptoss", *(pytest.param(k, marks=pytest.mark.slow) for k in ("llama", "qwen2", "gpt2"))]


@pytest.mark.parametrize("model_dir", ONE_MODEL, indirect=True)
def test_bad_requests_get_an_error_and_the_rest_completes(model_dir, tmp_path):
    """Each bad line gets its own one-line error result, in its place; the good ones are answered.
    Lines are counted from 1, blank ones included, in messages and in the ids of lines that have
    none."""
    m, root = model_dir
    lines = [
        {"id": "ok", "prompt_token_ids": [5, 6, 7], "max_tokens": 4},
        "{not json",
        {"id": "empty", "prompt_token_ids": []},
        {"id": "long", "prompt_token_ids": [1] * 65},
        {"id": "text", "prompt": "no tokenizer here"},
        {"id": "toomany", "prompt_token_ids": [1], "max_tokens": STEPS + 1},
        "",  # blank: no result, but counted as a line
        {"id": "big", "prompt_token_ids": [999999, 5]},
        {"id": "negative", "prompt_token_ids": [-5, 5]},
        {"id": "typo", "prompt_token_ids": [5], "max_tokenz": 3},
        {"id": "later", "prompt_token_ids": [5], "response_format": {"type": "json_object"}},
        {"id": "stop", "prompt_token_ids": [5], "stop": 5},
        {"id": "huge", "prompt_token_ids": [5], "top_k": 10**40},
        '{"id": "inf", "prompt_token_ids": [5], "temperature": Infinity}',
        "[" * 100000 + "]" * 100000,
        {"id": "ok2", "prompt_token_ids": [9], "max_tokens": 2},
    ]
    inp = tmp_path / "in.jsonl"
    write_jsonl(inp, lines)
    with open(inp, "ab") as f:  # a line that is not UTF-8, then one more good request
        f.write(b'{"id": "latin1", "prompt": "caf\xe9"}\n{"id": "ok3", "prompt_token_ids": [4]}\n')
    out = tmp_path / "out.jsonl"
    run_main(root, str(inp), out)
    r = {x["id"]: x for x in read_jsonl(out)}
    assert [x["id"] for x in read_jsonl(out)] == [
        "ok", 2, "empty", "long", "text", "toomany", "big", "negative", "typo", "later", "stop",
        "huge", "inf", 15, "ok2", 17, "ok3"]
    assert r["ok"]["token_ids"] == hf_greedy(m, [5, 6, 7], 4) and r["ok"]["finish_reason"] == "length"
    assert r[2]["error"].startswith("line 2 is not valid JSON")
    assert r["empty"] == {"id": "empty", "error": "the prompt is empty"}
    assert "65 tokens, more than generation.max_prompt_len=64" in r["long"]["error"]
    assert "no tokenizer" in r["text"]["error"]
    assert "max_tokens=33 exceeds generation.max_new_tokens=32" in r["toomany"]["error"]
    assert "prompt_token_ids[0]=999999" in r["big"]["error"] and f"{VOCAB} ids" in r["big"]["error"]
    assert "prompt_token_ids[0]=-5" in r["negative"]["error"]
    assert "'max_tokenz'" in r["typo"]["error"] and "'max_tokens'" in r["typo"]["error"]
    # the tiny checkpoints have no tokenizer, which a format's grammar needs
    assert r["later"]["error"] == "response_format: this checkpoint has no tokenizer, which a format needs"
    assert r["stop"]["error"].startswith("stop=5")
    assert "top_k" in r["huge"]["error"] and "out of range" in r["huge"]["error"]
    assert "temperature" in r["inf"]["error"]
    assert r[15]["error"].startswith("line 15 ")
    assert r[17]["error"] == "line 17 is not UTF-8 (byte 32 of the line)"
    for good, prompt, n in (("ok2", [9], 2), ("ok3", [4], STEPS)):
        assert r[good]["token_ids"] == hf_greedy(m, prompt, n)


def test_logprobs_and_scores_match_transformers_log_softmax(model_dir, tmp_path):
    """Through the CLI, at float32: each generated token's log-probability and its alternatives
    (greedy and sampled rows), every prompt token's, a continuation's sum and whether it is the
    greedy one, and n samples of one prompt, all against transformers' log_softmax of its logits
    over the whole sequence; bad values get errors naming their field."""
    import torch

    m, root = model_dir
    rng = np.random.RandomState(8)
    p0, p1, ctx = ([int(t) for t in rng.randint(0, VOCAB, n)] for n in (9, 14, 11))
    with torch.no_grad():
        greedy_cont = m(torch.tensor([ctx])).logits[0, -1].argmax().item()
    lines = [
        {"id": "greedy", "prompt_token_ids": p0, "max_tokens": 6, "logprobs": 5, "prompt_logprobs": 3},
        {"id": "sampled", "prompt_token_ids": p1, "max_tokens": 5, "temperature": 1.0, "seed": 7,
         "logprobs": True, "top_logprobs": 2},
        {"id": "cont", "prompt_token_ids": ctx, "continuation": [int(rng.randint(VOCAB)), 3]},
        {"id": "greedy_cont", "prompt_token_ids": ctx, "continuation": [greedy_cont]},
        {"id": "score", "prompt_token_ids": p1, "max_tokens": 0, "prompt_logprobs": 0},
        {"id": "samples", "prompt_token_ids": p0, "max_tokens": 4, "temperature": 1.0, "n": 3,
         "logprobs": 1},
        {"id": "bad_n", "prompt_token_ids": p0, "n": 0},
        {"id": "bad_k", "prompt_token_ids": p0, "logprobs": 21},
        {"id": "bad_cont", "prompt_token_ids": p0, "continuation": []},
        {"id": "bad_zero", "prompt_token_ids": p0, "max_tokens": 0},
    ]
    out = tmp_path / "out.jsonl"
    run_main(root, write_jsonl(tmp_path / "in.jsonl", lines), out)
    r = {x["id"]: x for x in read_jsonl(out)}

    def ref(seq):  # transformers' log-probabilities [len(seq), V], float32
        with torch.no_grad():
            return torch.log_softmax(m(torch.tensor([seq])).logits[0].float(), -1).numpy()

    def check(entry, logp, token, k):  # one token's entry against its row of log-probabilities
        assert entry["id"] == token and abs(entry["logprob"] - logp[token]) < 1e-4
        top = entry["top_logprobs"]
        assert len(top) == k
        np.testing.assert_allclose([t["logprob"] for t in top], np.sort(logp)[::-1][:k], atol=1e-4)
        np.testing.assert_allclose([logp[t["id"]] for t in top], [t["logprob"] for t in top], atol=1e-4)

    for rid, prompt, k in (("greedy", p0, 5), ("sampled", p1, 2)):
        got = r[rid]
        assert len(got["logprobs"]["content"]) == len(got["token_ids"]) == got["usage"]["completion_tokens"]
        lp = ref(prompt + got["token_ids"])
        for j, (entry, token) in enumerate(zip(got["logprobs"]["content"], got["token_ids"])):
            check(entry, lp[len(prompt) - 1 + j], token, k)
    assert r["greedy"]["token_ids"] == hf_greedy(m, p0, 6)
    for rid, prompt, k in (("greedy", p0, 3), ("score", p1, 0)):
        got, lp = r[rid]["prompt_logprobs"], ref(prompt)
        assert len(got) == len(prompt) and got[0] is None
        for j in range(1, len(prompt)):
            check(got[j], lp[j - 1], prompt[j], k)
    assert r["score"]["token_ids"] == [] and r["score"]["usage"]["completion_tokens"] == 0
    for rid in ("cont", "greedy_cont"):
        cont = lines[[x["id"] for x in lines].index(rid)]["continuation"]
        lp = ref(ctx + cont)
        want = sum(lp[len(ctx) - 1 + j, t] for j, t in enumerate(cont))
        greedy = all(lp[len(ctx) - 1 + j].argmax() == t for j, t in enumerate(cont))
        got = r[rid]["continuation"]
        assert abs(got["logprob"] - want) < 1e-4 and got["is_greedy"] == greedy
        assert got["token_ids"] == cont and r[rid]["token_ids"] == []
    assert r["greedy_cont"]["continuation"]["is_greedy"]
    choices = r["samples"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert r["samples"]["usage"] == {"prompt_tokens": len(p0), "completion_tokens": 12}
    for c in choices:
        lp = ref(p0 + c["token_ids"])
        for j, (entry, token) in enumerate(zip(c["logprobs"]["content"], c["token_ids"])):
            check(entry, lp[len(p0) - 1 + j], token, 1)
    assert "n=0" in r["bad_n"]["error"] and "out of range" in r["bad_n"]["error"]
    assert "logprobs=21" in r["bad_k"]["error"]
    assert "continuation" in r["bad_cont"]["error"] and "no tokens" in r["bad_cont"]["error"]
    assert "max_tokens=0" in r["bad_zero"]["error"]


@pytest.mark.parametrize("model_dir", ONE_MODEL, indirect=True)
def test_a_rerun_skips_what_is_already_done(model_dir, tmp_path):
    """A partial file left by an interrupted run: its results are kept, the rest is generated."""
    m, root = model_dir
    rows = [{"id": i, "prompt_token_ids": [i + 1, i + 2], "max_tokens": 3} for i in range(5)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_main(root, inp, out)
    full = read_jsonl(out)
    partial = open(str(out) + ".partial", "w")
    digest = __import__("hashlib").sha256("\n".join(open(inp).read().splitlines()).encode()).hexdigest()
    partial.write(json.dumps({"input_sha256": digest}) + "\n")
    marked = dict(full[3], text="from the partial file")
    partial.write(json.dumps({"_index": 3, **marked}) + "\n" + '{"_index": 1, "id": 1, "te')  # cut short
    partial.close()
    os.remove(out)
    summary = run_main(root, inp, out).stderr.strip().splitlines()[-2]
    again = read_jsonl(out)
    assert again[3]["text"] == "from the partial file"
    assert [r["token_ids"] for r in again] == [r["token_ids"] for r in full]
    # this run's own work apart: 4 requests of 2 prompt and 3 completion tokens each
    assert "5 requests (1 already done, 0 errors, 4 generated): 8 prompt + 12 completion" in summary


@pytest.mark.parametrize("model_dir", ONE_MODEL, indirect=True)
def test_a_finished_output_is_left_as_it_is_unless_overwrite_is_asked(model_dir, tmp_path):
    """A rerun of a finished job says so and exits 0 without touching the results (and with no
    compilation cache line: it asked the cache nothing); another input's results are refused in
    one line; io.overwrite=True generates them again."""
    _, root = model_dir
    rows = [{"id": f"r{i}", "prompt_token_ids": [i + 1, i + 2], "max_tokens": 3} for i in range(4)]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    run_main(root, inp, out)
    first = out.read_text()
    marked = "".join(json.dumps(dict(r, text="kept")) + "\n" for r in read_jsonl(out))
    out.write_text(marked)
    again = run_main(root, inp, out)
    assert out.read_text() == marked
    assert f"{out} already holds the results of {inp}'s 4 requests: nothing to do" in again.stderr
    assert "compilation cache" not in again.stderr
    other = write_jsonl(tmp_path / "other.jsonl", rows[:3])
    refused = run_main(root, other, out, check=False)
    assert refused.returncode != 0 and out.read_text() == marked
    assert refused.stderr.strip().splitlines()[-1] == (
        f"podrun: error: io.output={out} already holds 4 results of another input (this one has 3 "
        "requests): choose another io.output, or pass --config.io.overwrite=True to replace it")
    regenerated = run_main(root, inp, out, "--config.io.overwrite=True")
    assert out.read_text() == first
    assert "4 requests (0 errors, 4 generated)" in regenerated.stderr
    assert re.fullmatch(r"podrun\[0\]: compilation cache: [1-9]\d* hits, 0 misses",
                        regenerated.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("model_dir", ONE_MODEL, indirect=True)
def test_a_run_whose_every_request_failed_exits_non_zero(model_dir, tmp_path):
    """The error lines are written all the same; the last line says why, in one line."""
    _, root = model_dir
    rows = [{"id": i, "prompt_token_ids": [1], "max_tokens": STEPS + 1} for i in range(3)]
    out = tmp_path / "out.jsonl"
    p = run_main(root, write_jsonl(tmp_path / "in.jsonl", rows), out, check=False)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        "podrun: error: every one of the 3 requests failed; line 1: "
        f"max_tokens={STEPS + 1} exceeds generation.max_new_tokens={STEPS}")
    assert [r["id"] for r in read_jsonl(out)] == [0, 1, 2]
    # a rerun finds them finished, and fails as that run did, until the cause is fixed
    again = run_main(root, write_jsonl(tmp_path / "in.jsonl", rows), out, check=False)
    assert again.returncode != 0 and "restoring" not in again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"podrun: error: every one of the 3 requests failed (in {out}, an earlier run's); line 1: "
        f"max_tokens={STEPS + 1} exceeds generation.max_new_tokens={STEPS}; fix the cause and pass "
        "--config.io.overwrite=True to generate them again")


@pytest.mark.parametrize("kind", ["llama"])
def test_bad_setups_fail_in_one_line_and_write_nothing(kind, tmp_path_factory, tmp_path):
    m = tiny_hf(kind)
    root = tmp_path_factory.mktemp("bad")
    m.save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2]}])
    out = tmp_path / "out.jsonl"
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    cases = {
        "checkpoint.path=/nonexistent: no such directory": ("--config.checkpoint.path=/nonexistent",),
        f"io.input={tmp_path}/blank.jsonl holds no requests": (f"--config.io.input={tmp_path}/blank.jsonl",),
        "= 6 devices but 8 are visible": (EIGHT, "--config.mesh.data=6"),
        "'kv_heads' of size 4 does not divide over mesh axes model (8 shards)": (EIGHT, "--config.mesh.data=1",
                                                                                 "--config.mesh.model=8"),
        "--config.generation.batchsize: the config has no field 'generation.batchsize'; did you mean "
        "'batch_size'?": ("--config.generation.batchsize=2",),
        "--config.foo.bar: the config has no field 'foo'": ("--config.foo.bar=1",),
        "--config.precision.scan_layers: precision.scan_layers is now programs.scan_layers": (
            "--config.precision.scan_layers=true",),
        f"checkpoint.chat_template={tmp_path}/none.jinja: no such file": (
            f"--config.checkpoint.chat_template={tmp_path}/none.jinja",),
        f"io.output={tmp_path}/in.jsonl/out.jsonl: {tmp_path}/in.jsonl is a file, not a folder": (
            f"--config.io.output={tmp_path}/in.jsonl/out.jsonl",),
        f"io.output={tmp_path} is a folder": (f"--config.io.output={tmp_path}",),
    }
    for message, overrides in cases.items():
        p = run_main(root, inp, out, *overrides, check=False)
        assert p.returncode != 0
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("podrun: error:") and message in last, p.stderr[-2000:]
        assert "Traceback" not in p.stderr and "restoring" not in p.stderr  # before the model loads
        assert not out.exists() and not os.path.exists(str(out) + ".partial")
    for config, message in (("configs/nonexistent.py", "--config: [Errno 2] No such file or directory"),
                            ("configs/smollm2_cpu.py:mesh4", "takes no argument or :mesh8, not :mesh4")):
        p = podrun("runner.main", f"--config={config}", check=False)
        assert p.returncode != 0 and p.stderr.strip().count("\n") == 0, p.stderr[-2000:]
        assert p.stderr.startswith("podrun: error:") and message in p.stderr
    # an embedded model is fetched only into ~/.cache/podrun/checkpoints, never into a mistyped path
    p = podrun("runner.main", "--config=configs/smollm2_cpu.py", f"--config.checkpoint.path={root / 'typo'}",
               f"--config.io.input={inp}", f"--config.io.output={out}", check=False)
    assert p.returncode != 0 and not (root / "typo").exists()
    assert p.stderr.strip().splitlines()[-1] == (
        f"podrun: error: checkpoint.path={root / 'typo'} does not exist; checkpoint.fetch=smollm2-135m-instruct "
        "fetches only into ~/.cache/podrun/checkpoints/ (convert a checkpoint into that path with python -m "
        "runner.tools.convert, or leave checkpoint.path to the config)")
    # a checkpoint whose weights disagree with its metadata
    meta = json.loads((root / "ck" / "podrun.json").read_text())
    meta["model"]["config"]["num_layers"] = 3
    (root / "ck" / "podrun.json").write_text(json.dumps(meta))
    p = run_main(root, inp, out, check=False)
    assert p.returncode != 0 and "layers.2.attn_norm is missing" in p.stderr.strip().splitlines()[-1]
    assert not out.exists()
    p = podrun("runner.tools.convert", f"--source={root / 'nothing'}", f"--output={root / 'ck2'}", check=False)
    assert p.returncode != 0 and str(root / "nothing") in p.stderr.strip().splitlines()[-1]
    assert not (root / "ck2").exists()
