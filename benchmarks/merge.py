"""The merge of a split job (runner/results/parts.py): its time and memory on one core.

    python benchmarks/merge.py [--lines=1000000] [--parts=64] [--dir=/tmp/podrun-merge]

Writes a request file of --lines requests (a prompt of 60 to 600 characters each) and the --parts
part files a job of them would leave (results as podrun writes them: text, 20 to 200 token ids,
finish reason, usage), unless they are there from an earlier run, then merges them in a fresh
process pinned to one core; the same for a tenth of the lines. Prints each merge's wall time and
its process's peak RSS (resource.getrusage), so flat memory shows as the same peak for both. The
files are written and merged in processes of their own: Linux keeps a process's peak RSS across
exec, so the merge's must not start from the writer's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIG = {"benchmark": "merge"}


def write_job(folder: str, lines: int, count: int) -> tuple[str, str]:
    """The request file and the part files of a job of `lines` requests in `count` parts."""
    from runner.api.common import Line
    from runner.api.formats import FileFormat
    from runner.results import parts
    from runner.results.writer import input_digest

    os.makedirs(folder, exist_ok=True)
    inp, out = os.path.join(folder, f"in-{lines}.jsonl"), os.path.join(folder, f"out-{lines}.jsonl")
    if os.path.exists(inp) and all(os.path.exists(parts.part_path(out, i, count)) for i in range(count)):
        return inp, out
    rng = random.Random(0)
    words = "the king and his fool went out into the storm where no one could hear them".split()
    texts = [json.dumps({"id": f"r{i:07d}", "prompt": " ".join(rng.choices(words, k=rng.randint(15, 150))),
                         "max_tokens": rng.choice([16, 64, 256])}) for i in range(lines)]
    with open(inp, "w") as f:
        f.writelines(t + "\n" for t in texts)
    fmt = FileFormat(False, 1)
    work = [parts.estimate(Line(n, t), fmt, 256) for n, t in enumerate(texts, 1)]
    bounds = parts.split(work, count)
    digest = input_digest(texts)
    for i in range(count):
        part = parts.Part(i, count, bounds[i], bounds[i + 1], digest, CONFIG, out)
        header = {parts.HEADER: {**part.identity(), "requests": part.end - part.start, "errors": 0}}
        with open(part.path, "w") as f:
            f.write(json.dumps(header) + "\n")
            for k in range(part.start, part.end):
                ids = [rng.randrange(50_000) for _ in range(rng.randint(20, 200))]
                f.write(json.dumps({"id": f"r{k:07d}", "text": " ".join(rng.choices(words, k=len(ids))),
                                    "token_ids": ids, "finish_reason": "stop",
                                    "usage": {"prompt_tokens": 40, "completion_tokens": len(ids)}}) + "\n")
    return inp, out


def merge_here(inp: str, out: str, count: int) -> None:
    """One merge in this process, pinned to one core: its wall time and this process's peak RSS."""
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    from runner.results import parts

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    m = parts.merge(inp, out, count, CONFIG)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size = os.path.getsize(out)
    print(f"{m.requests} result lines ({size / 2**20:.0f} MiB) from {count} parts: {wall:.1f} s "
          f"({m.requests / wall:,.0f} lines/s) on one core; peak RSS {peak / 1024:.0f} MiB "
          f"({before / 1024:.0f} MiB before the merge)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--parts", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/podrun-merge")
    ap.add_argument("--write", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs=2, metavar=("INPUT", "OUTPUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.write:
        print(" ".join(write_job(a.dir, a.lines, a.parts)))
        return
    if a.merge:
        merge_here(*a.merge, a.parts)
        return
    for lines in (a.lines // 10, a.lines):
        t0 = time.perf_counter()
        inp, out = subprocess.run([sys.executable, __file__, f"--lines={lines}", f"--parts={a.parts}",
                                   f"--dir={a.dir}", "--write"], check=True, capture_output=True,
                                  text=True).stdout.split()
        print(f"{lines} requests and {a.parts} parts ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        subprocess.run([sys.executable, __file__, f"--parts={a.parts}", "--merge", inp, out], check=True)


if __name__ == "__main__":
    main()
