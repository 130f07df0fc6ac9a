"""gs:// everywhere, against a GCS emulator on 127.0.0.1: checkpoints (Orbax through tensorstore),
request and result files, the per-batch partial objects, and the compilation cache."""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import urllib.request

import jax
import jax.numpy as jnp
import pytest

from runner.checkpoints import store
from sharding.mesh import MeshShape, make_mesh
from sharding.rules import Rules
from tests.reference import hf_greedy, tiny_hf
from tests.test_end_to_end import ROOT, podrun, write_jsonl
from tests.test_multihost import free_port

BUCKET = "podrun-test"
GS = f"gs://{BUCKET}"
MESH = ("--config.mesh.data=2", "--config.mesh.expert=2", "--config.mesh.model=2")
CACHE_LINE = re.compile(r"compilation cache: (\d+) hits, (\d+) misses")


# gcp-storage-emulator, plus what GCS does and tensorstore relies on for OCDBT's read-modify-write
# of its manifest: the generation in download headers (x-goog-generation) and the generation
# preconditions (ifGenerationMatch -> 412, ifGenerationNotMatch -> 304). Without the header a
# sharded Orbax save fails with "Malformed StorageGeneration".
EMULATOR = """
import sys
from http import HTTPStatus
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

def generation(storage, bucket, name):
    try:
        return int(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return 0

def refused(request, current):
    match, not_match = request.query.get("ifGenerationMatch"), request.query.get("ifGenerationNotMatch")
    if match and int(match[0]) != current:
        return HTTPStatus.PRECONDITION_FAILED
    if not_match and int(not_match[0]) == current:
        return HTTPStatus.NOT_MODIFIED
    return None

def download(request, response, storage, *args, **kwargs):
    current = generation(storage, request.params["bucket_name"], request.params["object_id"])
    if current and (status := refused(request, current)):
        response.status = status
        return
    plain(request, response, storage, *args, **kwargs)
    if current:
        response["x-goog-generation"] = str(current)
        response["x-goog-metageneration"] = "1"

def media_upload(request, response, storage):
    request.data  # read the body whatever the answer
    current = generation(storage, request.params["bucket_name"], request.query["name"][0])
    if status := refused(request, current):
        response.status = status
        return
    upload(request, response, storage)

plain, upload = objects.download, objects._media_upload
objects.download, objects._media_upload = download, media_upload
server.create_server("127.0.0.1", int(sys.argv[1]), in_memory=True).run()
"""


@pytest.fixture(scope="module")
def gcs():
    """The emulator in its own process, in memory; gcsfs and tensorstore pointed at it (here and in
    every run started from here, which inherits os.environ). Yields a gcsfs filesystem."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", EMULATOR, str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url, timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"the GCS emulator exited with {proc.returncode}") from None
                proc_wait(proc, 0.1)
        else:
            raise RuntimeError(f"the GCS emulator did not answer on {url}")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("STORAGE_EMULATOR_HOST", url)
            mp.setenv("TENSORSTORE_GCS_HTTP_URL", url)
            mp.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "dummy")
            mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # else each bucket stalls 60 s
            import gcsfs

            fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
            fs.mkdir(BUCKET)
            yield fs
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def proc_wait(proc, seconds: float) -> None:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def objects(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(fs.find(prefix.removeprefix("gs://")))


@dataclasses.dataclass
class Setup:
    hf: object  # the transformers model
    root: pathlib.Path  # hf/, ck/, in.jsonl, local.jsonl
    rows: list  # the requests, one of them a malformed line
    local: str  # the results of a plain local run on one process


@pytest.fixture(scope="module")
def setup(gcs, tmp_path_factory) -> Setup:
    """A tiny GPT-OSS converted twice (local and gs://), 30 requests (one malformed) in both
    places, and the results of a plain local run on one process to compare against."""
    root = tmp_path_factory.mktemp("gcs")
    m = tiny_hf("gptoss", seed=5)
    m.save_pretrained(root / "hf")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={root / 'ck'}")
    podrun("runner.tools.convert", f"--source={root / 'hf'}", f"--output={GS}/ck")
    rows = [{"id": f"r{i}", "prompt_token_ids": [(7 * i + j) % 100 + 1 for j in range(1 + i % 9)],
            "max_tokens": 6 + i % 5, **({"temperature": 0.9, "seed": i} if i % 3 == 0 else {})}
            for i in range(29)]
    rows.insert(5, "{not json")
    inp = write_jsonl(root / "in.jsonl", rows)
    gcs.put(inp, f"{BUCKET}/in.jsonl")
    run(str(root / "ck"), inp, root / "local.jsonl", "")
    return Setup(m, root, rows, (root / "local.jsonl").read_text())


def args(ck, inp, out, cache, *extra):
    return [f"--config=configs/cpu.py:{ck}:mesh8", f"--config.io.input={inp}", f"--config.io.output={out}",
            "--config.generation.max_prompt_len=16", "--config.generation.max_new_tokens=10",
            "--config.generation.batch_size=4", f"--config.compilation_cache.dir={cache}", *MESH, *extra]


def run(ck, inp, out, cache, *extra, check=True):
    return podrun("runner.main", *args(ck, inp, out, cache, *extra), check=check)


def cache_counts(stderr: str) -> tuple[int, int]:
    found = CACHE_LINE.findall(stderr)
    assert found, stderr[-2000:]
    return tuple(int(x) for x in found[-1])


def test_everything_on_gcs_gives_the_local_results(gcs, setup):
    """Checkpoint, requests, results and compilation cache on gs://: the results equal a local run
    (and transformers, for the greedy rows); a second run compiles nothing."""
    p = run(f"{GS}/ck", f"{GS}/in.jsonl", f"{GS}/e2e/out.jsonl", f"{GS}/e2e/xla")
    assert gcs.cat(f"{BUCKET}/e2e/out.jsonl").decode() == setup.local
    assert objects(gcs, f"{GS}/e2e/out.jsonl.partial") == []  # the batch objects are gone
    assert objects(gcs, f"{GS}/e2e/xla")  # the cache holds the executables
    hits, misses = cache_counts(p.stderr)
    assert hits == 0 and misses > 0
    local = [json.loads(line) for line in setup.local.splitlines()]
    assert local[5]["id"] == 6 and "line 6 is not valid JSON" in local[5]["error"]  # 1-based
    for row, r in zip(setup.rows, local):
        if isinstance(row, dict) and "temperature" not in row:
            assert r["token_ids"] == hf_greedy(setup.hf, row["prompt_token_ids"], row["max_tokens"]), r["id"]

    again = run(f"{GS}/ck", f"{GS}/in.jsonl", f"{GS}/e2e/again.jsonl", f"{GS}/e2e/xla")
    assert cache_counts(again.stderr) == (misses, 0)  # every executable came from gs://
    assert gcs.cat(f"{BUCKET}/e2e/again.jsonl").decode() == setup.local


@pytest.mark.slow  # two processes on gs:// (tests/test_multihost.py runs two on local files)
def test_restore_onto_a_different_mesh_across_two_processes(gcs, setup):
    """Saved sharded over data=2 x model=4 in one process, restored over data=2 x expert=2 x model=2
    by two processes that each read their own shards from gs://; one process writes the results."""
    ck = setup.root / "ck"
    meta = store.load_metadata(str(ck))
    params = store.restore(str(ck), meta.model, Rules.make(make_mesh(MeshShape(data=2, model=4))),
                                jnp.float32)
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))  # saved in shards
    files = {f.name: f.read_bytes() for f in ck.iterdir() if f.is_file() and f.name != store.METADATA}
    store.save(f"{GS}/ck-2x4", meta, params, files)
    assert objects(gcs, f"{GS}/ck-2x4/params")

    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "runner.main",
         *args(f"{GS}/ck-2x4", f"{GS}/in.jsonl", f"{GS}/two/out.jsonl", "", "--config.mesh.num_cpu_devices=4",
               f"--config.distributed.coordinator=127.0.0.1:{port}", "--config.distributed.num_processes=2",
               f"--config.distributed.process_id={pid}")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    logs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][1][-2000:] + logs[1][1][-2000:]
    assert "2 process(es)" in logs[1][1]
    assert gcs.cat(f"{BUCKET}/two/out.jsonl").decode() == setup.local


@pytest.mark.slow  # test_partial_objects_are_used_and_checked_against_the_input resumes from them too
def test_a_killed_run_resumes_from_the_partial_objects(gcs, setup):
    """SIGKILL once a batch object exists, then rerun: every request exactly once, in order, equal
    to the uninterrupted local run, and the rerun generated only what was missing."""
    out = f"{GS}/killed/out.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "runner.main", *args(f"{GS}/ck", f"{GS}/in.jsonl", out, "")],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = []
    while p.poll() is None and len(seen) < 3:  # the header, the malformed line's error, a batch
        seen = objects(gcs, out + ".partial")
        proc_wait(p, 0.02)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    assert not gcs.exists(out.removeprefix("gs://"))
    kept = sum(len(gcs.cat(o).splitlines()) for o in seen[1:])

    again = run(f"{GS}/ck", f"{GS}/in.jsonl", out, "")
    done = int(re.search(r"(\d+) already done", again.stderr).group(1))
    assert kept <= done < len(setup.rows)
    assert f"{len(setup.rows) - done} to generate" in again.stderr
    assert gcs.cat(out.removeprefix("gs://")).decode() == setup.local
    assert objects(gcs, out + ".partial") == []


def test_partial_objects_are_used_and_checked_against_the_input(gcs, setup):
    """A result already in a batch object is kept as it is (not generated again); batch objects
    written for another input file stop the run in one line naming them."""
    out = f"{BUCKET}/prefilled/out.jsonl"
    lines = (setup.root / "in.jsonl").read_text().splitlines()
    header = {"input_sha256": hashlib.sha256("\n".join(lines).encode()).hexdigest()}
    gcs.pipe(f"{out}.partial/000000.jsonl", (json.dumps(header) + "\n").encode())
    local = [json.loads(line) for line in setup.local.splitlines()]
    marked = dict(local[3], text="from the partial object")
    gcs.pipe(f"{out}.partial/000001.jsonl", (json.dumps({"_index": 3, **marked}) + "\n").encode())
    p = run(f"{GS}/ck", f"{GS}/in.jsonl", f"gs://{out}", "")
    assert "1 already done" in p.stderr
    again = [json.loads(line) for line in gcs.cat(out).decode().splitlines()]
    assert again[3]["text"] == "from the partial object"
    assert again[:3] + again[4:] == local[:3] + local[4:]

    gcs.pipe(f"{out}.partial/000000.jsonl", b'{"input_sha256": "another file"}\n')
    p = run(f"{GS}/ck", f"{GS}/in.jsonl", f"gs://{out}", "", check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and last == (f"podrun: error: gs://{out}.partial belongs to a different input "
                                          "file; delete it or choose another io.output")


def test_missing_buckets_and_objects_fail_in_one_line_naming_the_path(gcs, setup):
    ck, inp, out = f"{GS}/ck", f"{GS}/in.jsonl", f"{GS}/bad/out.jsonl"
    cases = {
        "io.output=gs://no-such-bucket/out.jsonl: bucket gs://no-such-bucket does not exist":
            (ck, inp, "gs://no-such-bucket/out.jsonl", ""),
        "io.input=gs://no-such-bucket/in.jsonl: bucket gs://no-such-bucket does not exist":
            (ck, "gs://no-such-bucket/in.jsonl", out, ""),
        f"io.input={GS}/missing.jsonl: no such file": (ck, f"{GS}/missing.jsonl", out, ""),
        "checkpoint.path=gs://no-such-bucket/ck: no such directory": ("gs://no-such-bucket/ck", inp, out, ""),
        "compilation_cache.dir=gs://no-such-bucket/xla: bucket gs://no-such-bucket does not exist":
            (ck, inp, out, "gs://no-such-bucket/xla"),
    }
    for message, where in cases.items():
        p = run(*where, check=False)
        last = p.stderr.strip().splitlines()[-1]
        assert p.returncode != 0 and last.startswith("podrun: error: ") and message in last, p.stderr[-2000:]
        assert "Traceback" not in p.stderr
    p = podrun("runner.tools.convert", f"--source={setup.root / 'hf'}", "--output=gs://no-such-bucket/ck", check=False)
    assert p.returncode != 0
    assert "checkpoint=gs://no-such-bucket/ck: bucket gs://no-such-bucket does not exist" in p.stderr.splitlines()[-1]
    assert not gcs.exists("no-such-bucket")  # nothing created it on the way
    assert objects(gcs, f"{GS}/bad") == []
