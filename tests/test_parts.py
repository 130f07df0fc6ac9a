"""A request file split into parts (io.parts), answered by separate runs, and merged; --status."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import deque

import pytest

from runner.api.common import iter_lines, read_lines
from runner.api.formats import file_format, line_id
from runner.errors import RequestFileError
from runner.results import parts
from runner.results.writer import Results
from runner.settings import SettingsError, from_config
from runner.tools.merge import describe
from tests.reference import tiny_hf
from tests.test_end_to_end import ROOT, podrun, write_jsonl
from tests import test_gcs
from tests.test_multihost import free_port

CONFIG = {"sampling.temperature": 0.0, "generation.max_new_tokens": 32}
BUCKET, GS = test_gcs.BUCKET, test_gcs.GS
gcs = test_gcs.gcs  # the GCS emulator, a fixture


# --- the split ------------------------------------------------------------------------------------

def test_split_is_contiguous_and_no_part_is_a_line_away_from_the_mean():
    rng = random.Random(0)
    for _ in range(500):
        work = [rng.randint(1, 60) for _ in range(rng.randint(0, 80))]
        n = rng.randint(1, 24)
        bounds = parts.split(work, n)
        assert bounds == parts.split(list(work), n)  # the same on every host and rerun
        assert len(bounds) == n + 1 and bounds[0] == 0 and bounds[-1] == len(work)
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))
        for i in range(n):
            assert abs(sum(work[bounds[i]:bounds[i + 1]]) - sum(work) / n) <= max(work, default=0)


def test_a_heavy_line_gets_a_part_of_its_own_and_fewer_lines_than_parts_leave_parts_empty():
    assert parts.split([1, 1, 100, 1, 1], 3) == [0, 2, 3, 5]
    assert parts.split([5, 5], 4) == [0, 0, 1, 1, 2]


def lines_of(tmp_path, rows, name="in.jsonl"):
    path = write_jsonl(tmp_path / name, rows)
    lines = read_lines(path)
    return path, lines, file_format(lines)


def test_the_estimate_is_prompt_tokens_and_n_times_max_tokens(tmp_path):
    rows = [{"prompt_token_ids": [1] * 30, "max_tokens": 10},
            {"prompt_token_ids": [1] * 30},  # generation.max_new_tokens
            {"prompt_token_ids": [1] * 30, "max_tokens": 10, "n": 3},
            {"prompt": "x" * 400, "max_tokens": 0, "prompt_logprobs": 1},
            {"prompt": "x", "continuation": " y"},  # scoring: nothing generated
            {"prompt_token_ids": [1], "max_tokens": 10_000},  # an error: the default stands
            "not JSON"]
    _, lines, fmt = lines_of(tmp_path, rows)
    got = [parts.estimate(line, fmt, 32) for line in lines]
    chars = len(lines[3].text) // parts.CHARS_PER_TOKEN
    assert got == [40, 62, 60, chars, len(lines[4].text) // 4, 33, 1]
    batch = [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi " * 100}], "max_completion_tokens": 7}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": [5] * 9}}]
    _, lines, fmt = lines_of(tmp_path, batch, "batch.jsonl")
    assert [parts.estimate(line, fmt, 32) for line in lines] == [len(lines[0].text) // 4 + 7, 9 + 32]


def chat_rows(n: int, seed: int = 11) -> list[dict]:
    """Chat requests as benchmarks' chat workload has them: half short questions, half tasks over a
    passage of 300 to 1,200 characters, max_tokens 256."""
    rng = random.Random(seed)
    words = "the king and his fool went out into the storm where no one could hear them".split()
    rows = []
    for i in range(n):
        if i % 2:
            content = rng.choice(["What is gravity?", "Write a haiku about rain.", "Name five vegetables."])
        else:
            size = rng.choice([300, 600, 1200])
            content = "Summarize this scene:\n\n" + " ".join(rng.choice(words) for _ in range(size // 4))[:size]
        rows.append({"id": f"w{i:04d}", "messages": [{"role": "user", "content": content}], "max_tokens": 256,
                     "temperature": 0.7, "top_p": 0.9, "seed": i})
    return rows


@pytest.mark.parametrize("n, count", [(400, 16), (4000, 64)])
def test_a_chat_job_splits_with_its_largest_part_within_a_tenth_of_the_mean(tmp_path, n, count):
    _, lines, fmt = lines_of(tmp_path, chat_rows(n))
    work = [parts.estimate(line, fmt, 256) for line in lines]
    bounds = parts.split(work, count)
    sums = [sum(work[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(sums) <= 1.1 * sum(sums) / count


def test_io_part_comes_from_the_config_or_the_indexed_jobs_index(monkeypatch):
    from configs.cpu import get_config

    def settings(**io):
        c = get_config("/ck")
        c.io.update(io)
        return from_config(c)

    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    assert (settings().parts, settings().part) == (1, -1)
    assert settings(parts=4).part == -1  # the job refuses it (test_parts_run_separately_...)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert settings(parts=4).part == 3
    assert settings(parts=4, part=1).part == 1  # io.part wins
    assert settings().part == -1  # not split: the index is not ours
    with pytest.raises(SettingsError, match=r"JOB_COMPLETION_INDEX='3' .* io.parts=2"):
        settings(parts=2)
    with pytest.raises(SettingsError, match=r"io.part=4 is out of range: io.parts=4 has parts 0 to 3"):
        settings(parts=4, part=4)
    with pytest.raises(SettingsError, match=r"io.parts=0 must be at least 1"):
        settings(parts=0)
    # the settings that change results are recorded as given, the mesh and batch not among them
    a, b = settings(parts=4), get_config("/ck")
    b.mesh.data, b.generation.batch_size, b.generation.page_size = 2, 64, 16
    assert a.result_config == from_config(b).result_config
    b.sampling.seed = 5
    assert a.result_config != from_config(b).result_config


def test_streamed_lines_are_the_lines_read_whole(tmp_path):
    raw = b'\xef\xbb\xbf{"id": 1}\r\n\n  \n{"prompt": "a\xe2\x80\xa8b"}\n\xff\xfe not utf-8\n{"id": 3}'
    (tmp_path / "in.jsonl").write_bytes(raw)
    path = str(tmp_path / "in.jsonl")
    assert [(x.number, x.text) for x in iter_lines(path)] == [(x.number, x.text) for x in read_lines(path)]
    with pytest.raises(RequestFileError, match="no such file"):
        list(iter_lines(str(tmp_path / "missing.jsonl")))


# --- the merge, on parts written without a model -------------------------------------------------

def answer_parts(path: str, output: str, count: int, only=None, config=CONFIG, lines=None) -> list[str]:
    """Writes the parts of request file `path` (those in `only`) as runs would, each result
    {"id", "text", "usage"} (its line number of prompt tokens, 2 completion tokens; a Batch file's
    as a Batch result); the results a whole run would write, in order."""
    lines = lines or read_lines(path)
    fmt = file_format(lines)
    expected = []
    for i in range(count):
        part = parts.select(lines, fmt, i, count, 32, output, config)
        mine = lines[part.start:part.end]
        rows = [(k, {"id": line_id(x, fmt), "text": f"answer {x.number}",
                     "usage": {"prompt_tokens": x.number, "completion_tokens": 2}}) for k, x in enumerate(mine)]
        if fmt.openai_batch:
            rows = [(k, {"id": f"batch_req_{r['id']}", "custom_id": r["id"],
                         "response": {"status_code": 200, "body": {"usage": r["usage"]}}, "error": None})
                    for k, r in rows]
        expected += [json.dumps(r) + "\n" for _, r in rows]
        if only is None or i in only:
            results = Results(part.path, mine, header={"part": part.identity()})
            results.open()
            results.add(rows)
            results.write_final(len(mine), part.header(results, time.time()))
    return expected


@pytest.fixture
def job(tmp_path):
    rows = [{"id": f"r{i}", "prompt_token_ids": [1] * (1 + i * 7 % 23), "max_tokens": 1 + i % 9} for i in range(30)]
    rows[4] = "not JSON"  # its result carries its line number
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    return path, str(tmp_path / "out" / "res.jsonl")


def test_the_merge_writes_every_result_once_in_input_order(job):
    path, output = job
    expected = answer_parts(path, output, 7)
    merged = parts.merge(path, output, 7, CONFIG)
    assert open(output).read() == "".join(expected)
    assert merged.requests == 30 and merged.errors == 0
    assert sorted(os.listdir(os.path.dirname(output))) == sorted(
        ["res.jsonl"] + [os.path.basename(parts.part_path(output, i, 7)) for i in range(7)])  # no temporaries


def test_the_merge_lists_the_missing_parts(job):
    path, output = job
    answer_parts(path, output, 8, only={0, 1, 2, 4, 5, 6})
    with pytest.raises(RequestFileError, match=r"^2 of 8 parts are not done: part\(s\) 3, 7 \(part 3 writes "
                                               r".*res.jsonl.part-00003-of-00008.jsonl\)$"):
        parts.merge(path, output, 8, CONFIG)
    with pytest.raises(RequestFileError, match=r"^5 of 5 parts are not done: part\(s\) 0, 1, 2, 3, 4 .*; the part "
                                               r"files there were cut into 8$"):
        parts.merge(path, output, 5, CONFIG)  # another io.parts than the runs had
    assert not os.path.exists(output)


def test_the_merge_refuses_a_part_of_another_input_or_config(job, tmp_path):
    path, output = job
    answer_parts(path, output, 4)
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": f"z{i}", "prompt": "y"} for i in range(30)])
    answer_parts(other, output, 4, only={2})
    named = parts.part_path(output, 2, 4)
    with pytest.raises(RequestFileError, match=rf"^{named} was written for another input file \(its input_sha256"):
        parts.merge(path, output, 4, CONFIG)
    answer_parts(path, output, 4, only={2}, config=dict(CONFIG, **{"sampling.temperature": 0.7}))
    with pytest.raises(RequestFileError) as e:
        parts.merge(path, output, 4, CONFIG)
    assert str(e.value) == (f"{named} was written with config.sampling.temperature=0.7 (this run: 0.0): "
                            "delete it, or run with the settings it was written with")
    assert not os.path.exists(output)


@pytest.mark.parametrize("fault", ["doubled", "cut", "extra", "header"])
def test_the_merge_finds_a_lost_doubled_or_extra_result(job, fault):
    path, output = job
    expected = answer_parts(path, output, 5)
    named = parts.part_path(output, 1, 5)
    with open(named) as f:
        header, *results = f.read().splitlines(keepends=True)
    n = len(results)
    assert n >= 3
    changed, message = {
        "doubled": ([header, *results[:2], results[1], *results[3:]],
                    r"result 3 has id \"r\d+\" where input line \d+ has \"r\d+\""),
        "cut": ([header, *results[:-1]], rf"holds {n - 1} results for its {n} lines \(cut short\)"),
        "extra": ([header, *results, results[-1]], rf"holds more than its {n} results"),
        "header": (results, "is not a podrun part file .*: delete it, or choose another io.output")}[fault]
    open(named, "w").write("".join(changed))
    tail = "" if fault == "header" else ": delete it and run part 1 again"
    with pytest.raises(RequestFileError, match=rf"^{named} {message}{tail}$"):
        parts.merge(path, output, 5, CONFIG)
    assert not os.path.exists(output)
    assert len(os.listdir(os.path.dirname(output))) == 5  # the temporary is gone
    answer_parts(path, output, 5, only={1})
    parts.merge(path, output, 5, CONFIG)
    assert open(output).read() == "".join(expected)


def test_the_merge_checks_a_batch_files_custom_ids(tmp_path):
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": "x" * (1 + 40 * i % 300), "max_tokens": 4}} for i in range(12)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    output = str(tmp_path / "res.jsonl")
    expected = answer_parts(path, output, 3)
    merged = parts.merge(path, output, 3, CONFIG)
    assert open(output).read() == "".join(expected)
    assert (merged.requests, merged.prompt_tokens) == (12, sum(range(1, 13)))
    named = parts.part_path(output, 1, 3)
    header, first, *rest = open(named).read().splitlines(keepends=True)
    open(named, "w").write("".join([header, first.replace('"custom_id": "c', '"custom_id": "d'), *rest]))
    with pytest.raises(RequestFileError, match=r'result 1 has custom_id "d\d+" where input line \d+ has "c\d+"'):
        parts.merge(path, output, 3, CONFIG)


def test_status_shows_each_parts_state_from_its_files_alone(job):
    path, output = job
    lines = read_lines(path)
    fmt = file_format(lines)
    answer_parts(path, output, 4, only={0, 2})
    part = parts.select(lines, fmt, 1, 4, 32, output, CONFIG)
    for attempt in range(2):  # twice started (a kill between), two results in
        started = Results(part.path, lines[part.start:part.end], header={"part": part.identity()})
        started.open()
    started.add([(0, {"id": "r0", "text": "a"}), (1, {"id": "r1", "text": "b"})])
    part3 = parts.select(lines, fmt, 3, 4, 32, output, CONFIG)
    failed = Results(part3.path, lines[part3.start:part3.end], header={"part": part3.identity()})
    failed.open()
    failed.failed_attempt("RuntimeError: out of memory")
    states = parts.states(output, 4)
    assert [s.state for s in states] == ["done", "started", "done", "failed"]
    assert (states[1].results, states[1].attempts, states[3].attempts) == (2, 2, 1)
    report = describe(output, states, now=states[1].updated + 42).splitlines()
    assert report[0] == f"4 parts of {output}: 2 done, 1 started, 1 failed, 0 pending"
    rows = {int(x.split()[0]): x.split() for x in report[2:6]}
    h = states[0].header
    first = h["lines"][1]
    assert (h["prompt_tokens"], h["completion_tokens"]) == (sum(range(1, first + 1)), 2 * first)
    assert rows[0] == ["0", "done", f"1-{first}", str(first), "0", str(h["prompt_tokens"]), str(2 * first), "1",
                       f"{h['wall_s']:.1f}", "s"]
    assert rows[1][:4] == ["1", "started", f"{part.start + 1}-{part.end}", f"2/{part.end - part.start}"]
    assert rows[1][4:] == ["2", "last", "written", "42", "s", "ago"]
    assert rows[3][1:] == ["failed", f"{part3.start + 1}-{part3.end}", f"0/{part3.end - part3.start}", "1",
                           "RuntimeError:", "out", "of", "memory"]
    done = [h, states[2].header]
    assert report[6] == (f"done: {sum(x['requests'] for x in done)} requests (0 errors), "
                         f"{sum(x['prompt_tokens'] for x in done)} prompt + "
                         f"{sum(x['completion_tokens'] for x in done)} completion tokens in 2 parts")
    assert report[7].startswith("slowest part: ") and report[8] == "retried: part 1 (2 attempts)"
    os.remove(part3.path + ".partial")  # nothing there: pending
    assert parts.states(output, 4)[3].state == "pending"


# --- gs:// ---------------------------------------------------------------------------------------

def test_the_merge_reads_and_writes_gcs(gcs, job):
    path, _ = job
    output = f"{GS}/parts/res.jsonl"
    expected = answer_parts(path, output, 3, lines=read_lines(path))
    parts.merge(path, output, 3, CONFIG)
    assert gcs.cat(f"{BUCKET}/parts/res.jsonl").decode() == "".join(expected)
    assert sorted(p.rsplit("/", 1)[1] for p in gcs.ls(f"{BUCKET}/parts")) == sorted(
        ["res.jsonl"] + [f"res.jsonl.part-0000{i}-of-00003.jsonl" for i in range(3)])
    assert [s.state for s in parts.states(output, 3)] == ["done"] * 3


# --- runs of podrun -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("parts")
    tiny_hf("llama", seed=2).save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    return root


def varied_rows(n: int, seed: int = 3) -> list:
    """Requests of varied prompt lengths and max_tokens, some sampled with a seed of their own, some
    drawing sampling.seed's stream (which follows the line number), one that cannot be served."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = {"id": f"q{i}", "prompt_token_ids": [rng.randint(1, 120) for _ in range(rng.randint(1, 40))],
               "max_tokens": rng.choice([1, 3, 8, 16, 30])}
        if i % 4 == 0:
            row.update(temperature=0.8, seed=i)
        elif i % 5 == 1:
            row.update(temperature=0.9)
        rows.append(row)
    rows[n // 3] = {"id": "bad", "prompt_token_ids": [1], "max_tokens": 999}
    return rows


def run_args(root, inp, out, *extra):
    return [f"--config=configs/cpu.py:{root / 'ck'}", f"--config.io.input={inp}", f"--config.io.output={out}",
            "--config.generation.max_prompt_len=48", "--config.generation.max_new_tokens=32",
            "--config.generation.batch_size=4", "--config.mesh.data=1", "--config.mesh.num_cpu_devices=1",
            f"--config.compilation_cache.dir={root / 'xla'}", *extra]


def test_parts_run_separately_then_merged_are_the_single_runs_file(model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", varied_rows(24))
    podrun("runner.main", *run_args(model, inp, tmp_path / "one.jsonl"))
    out = tmp_path / "split" / "out.jsonl"
    refused = podrun("runner.main", *run_args(model, inp, out, "--config.io.parts=4"), check=False)
    assert refused.returncode != 0 and refused.stderr.strip().splitlines()[-1] == (
        "podrun: error: io.parts=4 splits the input: give --config.io.part=<0 to 3>, or run it as a "
        "Kubernetes Indexed Job (JOB_COMPLETION_INDEX)")
    logs = [podrun("runner.main", *run_args(model, inp, out, "--config.io.parts=4", f"--config.io.part={i}",
                                            *(("--config.mesh.data=2", "--config.mesh.num_cpu_devices=2")
                                              if i == 1 else ())))
            for i in (2, 0, 1)]
    assert "3 of 4 parts done; " in logs[-1].stderr and not out.exists()
    again = podrun("runner.main", *run_args(model, inp, out, "--config.io.parts=4", "--config.io.part=0"))
    assert "already holds part 0 of 4 (requests 1-" in again.stderr and not out.exists()
    other = podrun("runner.main", *run_args(model, inp, out, "--config.io.parts=4", "--config.io.part=0",
                                            "--config.generation.max_prompt_len=40"), check=False)
    assert other.returncode != 0 and other.stderr.strip().splitlines()[-1] == (
        f"podrun: error: {out}.part-00000-of-00004.jsonl was written with config.generation.max_prompt_len=48 "
        "(this run: 40): delete it, or run with the settings it was written with")
    last = podrun("runner.main", *run_args(model, inp, out, "--config.io.parts=4", "--config.io.part=3"))
    assert "all 4 parts are done: merging them into" in last.stderr
    assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    out.unlink()
    merged = podrun("runner.tools.merge", *run_args(model, inp, out, "--config.io.parts=4"))
    assert out.read_bytes() == (tmp_path / "one.jsonl").read_bytes()
    assert merged.stdout.startswith(f"merged 4 parts into {out}: 24 requests (1 errors), ")
    status = podrun("runner.tools.merge", *run_args(model, inp, out, "--config.io.parts=4", "--status")).stdout
    assert status.splitlines()[0] == f"4 parts of {out}: 4 done, 0 started, 0 failed, 0 pending"
    foreign = podrun("runner.tools.merge", *run_args(model, inp, out, "--config.io.parts=4",
                                                     "--config.sampling.seed=1"), check=False)
    assert foreign.returncode != 0 and foreign.stderr.strip().splitlines()[-1] == (
        f"podrun merge: error: {out}.part-00000-of-00004.jsonl was written with config.sampling.seed=0 "
        "(this run: 1): delete it, or run with the settings it was written with")


def assert_same_but_float_ties(model, inp, got, want) -> None:
    """got's lines are want's, in order, none lost or twice; a greedy line of a replica on another
    mesh may differ only from a token where the model's two best logits tie within float32's
    error (transformers' logits, 1e-4 apart at most): the replicas' meshes sum in other orders."""
    import torch
    import transformers

    got, want = got.read_text().splitlines(), want.read_text().splitlines()
    assert [json.loads(x)["id"] for x in got] == [json.loads(x)["id"] for x in want]
    requests = {r["id"]: r for r in map(json.loads, open(inp))}
    hf = None
    for a, b in zip(got, want):
        if a == b:
            continue
        a, b = json.loads(a), json.loads(b)
        r = requests[a["id"]]
        assert r.get("temperature", 0) == 0, (a, b)  # sampled lines are the same
        i = next(i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y)
        assert a["token_ids"][:i] == b["token_ids"][:i]
        hf = hf or transformers.AutoModelForCausalLM.from_pretrained(model / "hf").eval()
        with torch.no_grad():
            logits = hf(torch.tensor([r["prompt_token_ids"] + a["token_ids"][:i]])).logits[0, -1]
        x, y = a["token_ids"][i], b["token_ids"][i]
        assert abs(float(logits[x] - logits[y])) < 1e-4 and float(logits.max() - logits[x]) < 1e-4, (a["id"], i)


# Replicas as Kubernetes runs them: an Indexed Job of 16 completions, 4 pods at a time, each pod
# given its index in JOB_COMPLETION_INDEX, a pod killed at any moment retried with its index.
REPLICAS = {  # slices of different sizes and engines; one of them two processes on data x model
    "one_device": ("--config.mesh.data=1", "--config.mesh.num_cpu_devices=1"),
    "paged": ("--config.mesh.data=1", "--config.mesh.num_cpu_devices=1", "--config.generation.page_size=4",
              "--config.generation.chunk_tokens=16", "--config.generation.batch_size=8"),
    "data2": ("--config.mesh.data=2", "--config.mesh.num_cpu_devices=2", "--config.generation.batch_size=6"),
    "two_processes": ("--config.mesh.data=2", "--config.mesh.model=2", "--config.mesh.num_cpu_devices=2"),
}


@pytest.mark.slow
def test_replicas_killed_at_random_and_retried_write_the_single_runs_file(model, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", varied_rows(400, seed=7))
    podrun("runner.main", *run_args(model, inp, tmp_path / "one.jsonl"))
    out = tmp_path / "split" / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)

    logs = tmp_path / "logs"
    logs.mkdir()

    def start(kind: str, index: int) -> list[subprocess.Popen]:
        pod = dict(env, JOB_COMPLETION_INDEX=str(index))
        base = [sys.executable, "-m", "runner.main", *run_args(model, inp, out, "--config.io.parts=16"),
                *REPLICAS[kind]]
        port = free_port()
        many = ["--config.distributed.coordinator=127.0.0.1:{port}", "--config.distributed.num_processes=2",
                "--config.distributed.process_id={pid}"] if kind == "two_processes" else []
        procs = []
        for pid in (0, 1) if many else (0,):
            log = logs / f"{kind}-part{index}-{time.monotonic():.1f}-{pid}.txt"
            with open(log, "w") as f:
                procs.append(subprocess.Popen([*base, *(x.format(port=port, pid=pid) for x in many)], cwd=ROOT,
                                              env=pod, stdout=subprocess.DEVNULL, stderr=f))
            procs[-1].log = log
        return procs

    rng = random.Random(1)
    todo = deque(range(16))
    running: dict[str, tuple[int, list[subprocess.Popen], float]] = {}  # kind -> index, its processes, kill at
    kills, resumed, finished, deadline = 0, 0, [], time.monotonic() + 1500
    while todo or running:
        assert time.monotonic() < deadline, "the replicas did not finish"
        for kind in REPLICAS:
            if kind not in running and todo:
                index = todo.popleft()
                # half the starts are killed (8 at most): at a random moment, or while generating
                doomed = kills < 8 and rng.random() < 0.5
                kill_at = (time.monotonic() + rng.uniform(1, 15) if rng.random() < 0.5 else -rng.uniform(0.05, 0.5)) \
                    if doomed else float("inf")
                running[kind] = (index, start(kind, index), kill_at)
        time.sleep(0.2)
        for kind, (index, procs, kill_at) in list(running.items()):
            partial = parts.part_path(str(out), index, 16) + ".partial"
            if all(p.poll() is not None for p in procs):
                assert all(p.returncode == 0 for p in procs), procs[0].log.read_text()[-3000:]
                finished.append(index)
                del running[kind]
            elif kill_at < 0 and os.path.exists(partial) and '"_index"' in open(partial).read():
                running[kind] = (index, procs, time.monotonic() - kill_at)  # generating: soon
            elif 0 <= kill_at < time.monotonic():
                resumed += os.path.exists(partial) and '"_index"' in open(partial).read()
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                for p in procs:
                    p.wait()
                kills += 1
                todo.appendleft(index)  # Kubernetes starts the index again
                del running[kind]
    print(f"{kills} kills, {resumed} with results in their partial file")
    assert kills >= 3 and resumed >= 1 and sorted(set(finished)) == list(range(16))
    assert_same_but_float_ties(model, inp, out, tmp_path / "one.jsonl")
    status = podrun("runner.tools.merge", *run_args(model, inp, out, "--config.io.parts=16", "--status")).stdout
    assert status.splitlines()[0] == f"16 parts of {out}: 16 done, 0 started, 0 failed, 0 pending"
    assert status.splitlines()[-1].startswith("retried: part ")  # a kill while generating, at least
    print(status)
