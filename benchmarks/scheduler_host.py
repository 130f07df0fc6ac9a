"""The scheduler's own host time per call, where a fast accelerator's step takes a few ms.

    python benchmarks/scheduler_host.py [--rows=256] [--requests=1000] [--prompt=256] [--new=256]

vLLM's throughput workload by default (1,000 requests of 256 prompt and 256 new tokens) through
the real Scheduler (runner/engine/scheduler.py) on runner/tools/simulate.py's stand-in,
whose calls cost nothing: what is left is the scheduler's work between calls (admission, pages,
the batch's host arrays, taking each row's tokens in), which a job adds to every device call.
The engine is llama:tiny's, unallocated, with --rows rows and room for every row at its longest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs on a device: the engine is abstract

import jax  # noqa: E402
import numpy as np  # noqa: E402

from models.policy import Policy  # noqa: E402
from models.registry import Model  # noqa: E402
from runner.engine import Engine, Request  # noqa: E402
from runner.tools.simulate import Costs, simulate  # noqa: E402
from sharding.mesh import MeshShape, make_mesh  # noqa: E402
from sharding.rules import Rules  # noqa: E402


class Free(Costs):
    def call(self, p, contexts, chunk_at) -> float:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    model = Model.named("llama:tiny")
    rules = Rules.make(make_mesh(MeshShape(data=1), jax.devices()[:1]))
    policy = Policy(kernels=False)
    engine = Engine(model, model.abstract_params(rules, policy), rules, policy, a.rows, a.prompt,
                    a.new, 16, allocate=False)
    rng = np.random.RandomState(0)
    requests = [Request(tuple(int(t) for t in rng.randint(1, 100, a.prompt)), a.new)
                for _ in range(a.requests)]
    for rep in range(a.reps):
        t0 = time.perf_counter()
        out = simulate(engine.layout, requests, [[a.new]] * a.requests, Free(), True)
        took = time.perf_counter() - t0
        print(f"{a.rows} rows, {len(out.calls)} calls: the scheduler's host time {1e3 * out.host_s / len(out.calls):.2f} "
              f"ms a call ({out.host_s:.2f} s in all; the simulation {took:.2f} s)")


if __name__ == "__main__":
    main()
