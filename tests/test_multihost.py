"""Several hosts simulated on 127.0.0.1: 2 processes x 4 CPU devices, against 1 process x 8."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.reference import tiny_hf
from tests.test_end_to_end import ROOT, podrun, read_jsonl, write_jsonl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    tiny_hf("gptoss", seed=5).save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    rows = [{"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 100 + 1 for j in range(1 + i % 9)],
             "max_tokens": 6 + i % 5, **({"temperature": 0.9, "seed": i} if i % 3 == 0 else {})}
            for i in range(10)]
    return root, write_jsonl(root / "in.jsonl", rows)


def args(root, inp, out, *extra):
    return [f"--config=configs/cpu.py:{root / 'ck'}:mesh8", f"--config.io.input={inp}",
            f"--config.io.output={out}", "--config.generation.max_prompt_len=16",
            "--config.generation.max_new_tokens=10", "--config.generation.batch_size=4",
            "--config.mesh.expert=2", "--config.compilation_cache.dir=", *extra]


def start(root, inp, out, pid, port, *extra):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "runner.main", *args(root, inp, out, "--config.mesh.num_cpu_devices=4",
           f"--config.distributed.coordinator=127.0.0.1:{port}", "--config.distributed.num_processes=2",
           f"--config.distributed.process_id={pid}", *extra)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("across", [(), pytest.param(("--config.mesh.dcn.data=2",), marks=pytest.mark.slow),
                                    pytest.param(("--config.generation.page_size=4",
                                                  "--config.generation.chunk_tokens=16"),
                                                 marks=pytest.mark.slow)],
                         ids=["one_slice", "data_over_dcn", "small_pages"])
def test_two_processes_write_the_same_results_as_one(setup, tmp_path, across):
    """Each process runs its scheduler over the same requests, and the two write what one process
    writes. data_over_dcn: each process plays a slice, and the data axis alone crosses between
    them (slow: test_compile's two-slice deployment checks that layout in the default suite).
    small_pages (slow): pages of 4 tokens and chunks of 16, so that prompts take several calls."""
    root, inp = setup
    podrun("runner.main", *args(root, inp, tmp_path / "one.jsonl"))
    port = free_port()
    procs = [start(root, inp, tmp_path / "two.jsonl", pid, port, *across) for pid in (0, 1)]
    logs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][1][-2000:] + logs[1][1][-2000:]
    assert open(tmp_path / "two.jsonl").read() == open(tmp_path / "one.jsonl").read()  # written once, in order
    assert any("podrun[1]:" in line for line in logs[1][1].splitlines())  # logs say who speaks
    assert len(read_jsonl(tmp_path / "two.jsonl")) == 10


def test_a_dead_process_makes_the_other_exit_within_the_heartbeat_timeout(setup, tmp_path):
    root, _ = setup
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt_token_ids": [i % 90 + 1, 5], "max_tokens": 10}
                                              for i in range(2000)])
    port = free_port()
    slow = ("--config.generation.batch_size=2", "--config.distributed.heartbeat_timeout_s=5")
    procs = [start(root, inp, tmp_path / "out.jsonl", pid, port, *slow) for pid in (0, 1)]
    partial = tmp_path / "out.jsonl.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().count("\n") > 1):  # generating, together
        assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[1][-2000:]
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGKILL)  # now process 1 dies without a word
    killed = time.monotonic()
    _, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode != 0
    assert time.monotonic() - killed < 60
    assert "another task died" in err or "unhealthy" in err, err[-3000:]
    assert not (tmp_path / "out.jsonl").exists()  # the partial file keeps what was done


def test_an_unreachable_coordinator_is_a_one_line_error_within_the_timeout(setup, tmp_path):
    root, inp = setup
    began = time.monotonic()
    p = start(root, inp, tmp_path / "out.jsonl", 1, free_port(), "--config.distributed.timeout_s=3")
    _, err = p.communicate(timeout=120)
    assert p.returncode not in (0, -6, 134)  # an error exit, not jax's abort
    assert time.monotonic() - began < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith("podrun: error: process 1: distributed.coordinator=127.0.0.1:") and "did not answer" in last, err[-2000:]
    assert not (tmp_path / "out.jsonl").exists()
