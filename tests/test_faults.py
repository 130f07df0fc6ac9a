"""Runs killed with SIGKILL at random points, or stopped by Ctrl-C, and restarted: every request
exactly once."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.reference import tiny_hf
from tests.test_end_to_end import ROOT, podrun, read_jsonl, write_jsonl


@pytest.mark.slow
@pytest.mark.parametrize("engine", [(), ("--config.generation.page_size=4",)],
                         ids=["pages16", "pages4"])
def test_sigkill_at_random_points_then_restart_loses_and_repeats_nothing(tmp_path, engine):
    """The engine's programs compile on a thread of their own, into the compilation cache that a
    kill can interrupt; pages4: the same with pages of 4 tokens."""
    tiny_hf("llama", seed=2).save_pretrained(tmp_path / "hf")
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    inp = write_jsonl(tmp_path / "in.jsonl",
                      [{"id": i, "prompt_token_ids": [i % 90 + 1, 5], "max_tokens": 64} for i in range(2000)])

    def args(output):
        return [f"--config=configs/cpu.py:{tmp_path / 'ck'}", f"--config.io.input={inp}",
                f"--config.io.output={output}", "--config.generation.batch_size=2",
                "--config.generation.max_new_tokens=64", "--config.mesh.data=1",
                "--config.mesh.num_cpu_devices=1", "--config.generation.max_prompt_len=16",
                f"--config.compilation_cache.dir={tmp_path / 'xla'}", *engine]

    env = dict(os.environ, PYTHONPATH=ROOT)
    rng = random.Random(0)
    kills = 0
    for _ in range(40):  # an uninterrupted run takes ~30 s; each try gets 4 to 10 s, of which
        # the start (imports, restore, programs from the cache) takes about 4 on 2 cores
        p = subprocess.Popen([sys.executable, "-m", "runner.main", *args(tmp_path / "out.jsonl")], cwd=ROOT,
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            p.wait(timeout=rng.uniform(4.0, 10.0))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            p.wait()
            kills += 1
            continue
        assert p.returncode == 0
        break
    else:
        pytest.fail("the run never completed")
    assert kills >= 2
    results = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in results] == list(range(2000))  # none lost, none twice, in order
    podrun("runner.main", *args(tmp_path / "uninterrupted.jsonl"))
    assert read_jsonl(tmp_path / "uninterrupted.jsonl") == results


def test_ctrl_c_exits_130_with_one_line_and_the_same_command_resumes(tmp_path):
    """SIGINT once the partial file holds a result: exit status 130, no traceback, and one last
    line of its own (not on the progress bar's) giving the results the partial file keeps, as the
    test counts them there; the same command then answers the rest, each request exactly once."""
    tiny_hf("llama", seed=2).save_pretrained(tmp_path / "hf")
    podrun("runner.tools.convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'ck'}")
    n = 300  # far more than finish between the first result and the signal
    inp = write_jsonl(tmp_path / "in.jsonl",
                      [{"id": i, "prompt_token_ids": [i % 90 + 1, 5], "max_tokens": 32} for i in range(n)])
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    cmd = [sys.executable, "-m", "runner.main", f"--config=configs/cpu.py:{tmp_path / 'ck'}",
           f"--config.io.input={inp}", f"--config.io.output={out}", "--config.generation.batch_size=2",
           "--config.generation.max_new_tokens=32", "--config.generation.max_prompt_len=16",
           f"--config.compilation_cache.dir={tmp_path / 'xla'}"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)

    def results_in_partial() -> list[int]:  # the indexes of its whole result lines
        if not partial.exists():
            return []
        lines = partial.read_text().split("\n")
        whole = [line for line in lines[1:-1] if line]  # the last piece: an unfinished line, or ""
        return [r["_index"] for r in map(json.loads, whole) if "_index" in r]

    # as a shell starts a command in the foreground: SIGINT's default action, whatever this process
    # inherited (a non-interactive shell's background job ignores SIGINT, and its children too)
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300  # a bound on a hung run, not a measurement
    while not results_in_partial() and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, stderr = p.communicate(timeout=300)
    assert p.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert stderr.endswith("\n")
    *before, last = stderr[:-1].split("\n")
    said = re.fullmatch(r"podrun: interrupted: (\d+) results kept in (\S+); the same command resumes from them",
                        last)
    assert said and said.group(2) == str(partial), stderr[-3000:]
    assert not any("interrupted" in line for line in before)
    kept = results_in_partial()
    assert int(said.group(1)) == len(kept) == len(set(kept)) and 0 < len(kept) < n
    assert not out.exists()

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{n} requests: {len(kept)} already done" in again.stderr
    assert [r["id"] for r in read_jsonl(out)] == list(range(n))  # each once, in order
    assert not partial.exists()
