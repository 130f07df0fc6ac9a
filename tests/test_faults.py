"""Runs killed with SIGKILL at random points and restarted: every request exactly once."""

import os
import random
import signal
import subprocess
import sys

import pytest

from tests.reference import tiny_hf
from tests.test_end_to_end import ROOT, podrun, read_jsonl, write_jsonl


@pytest.mark.slow
@pytest.mark.parametrize("engine", [(), ("--config.generation.page_size=4",)], ids=["unpaged", "paged"])
def test_sigkill_at_random_points_then_restart_loses_and_repeats_nothing(tmp_path, engine):
    """paged: the engine's programs compile on a thread of their own, into the compilation cache
    that a kill can interrupt."""
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
