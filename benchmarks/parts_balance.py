"""How evenly io.parts cuts a request file: each part's estimated work against the mean.

    python benchmarks/parts_balance.py REQUESTS.jsonl [--parts=16] [--max_new_tokens=256]

The cut and the estimate are runner/results/parts.py's (docs/parts.md); --max_new_tokens stands for
the deployment's generation.max_new_tokens, the max_tokens of a request that gives none.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runner.api.common import read_lines  # noqa: E402
from runner.api.formats import file_format  # noqa: E402
from runner.results import parts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests")
    ap.add_argument("--parts", type=int, default=16)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    a = ap.parse_args()
    lines = read_lines(a.requests)
    fmt = file_format(lines)
    for line in lines:
        line.release()  # decoded again below, as a replica decodes each line
    t0 = time.perf_counter()
    work = [parts.estimate(line, fmt, a.max_new_tokens) for line in lines]
    bounds = parts.split(work, a.parts)
    took = time.perf_counter() - t0
    sums = [sum(work[b:e]) for b, e in zip(bounds, bounds[1:])]
    sizes = [e - b for b, e in zip(bounds, bounds[1:])]
    mean = sum(sums) / a.parts
    print(f"{len(lines)} requests in {a.parts} parts of {min(sizes)} to {max(sizes)} requests: largest part "
          f"{max(sums) / mean:.3f}x the mean estimated work, smallest {min(sums) / mean:.3f}x (mean "
          f"{mean:,.0f} tokens; estimate and cut in {took:.2f} s)")


if __name__ == "__main__":
    main()
