"""Per-chip HBM traffic of one decode step of a TPU deployment, from XLA's AOT cost analysis,
against the floor a step must read (the declared weights and KV pool per chip, runner.tools.memory).

    JAX_PLATFORMS=cpu python benchmarks/tpu_decode_bytes.py configs/gptoss_v5e.py \
        [generation.batch_size=64 generation.kv_cache_gib=2.5 ...]

Compiles the engine the config builds (runner.engine.build) with one step a decode call, and of its
programs the decode call alone (decode_1: no loop), for the config's mesh.tpu_topology (libtpu
needed, as for runner.tools.compile), and prints temporaries, bytes accessed and their ratio to the
floor. Overrides are `section.key=value`. The floor's KV part is the pool's pages (what the rows
hold when the pool is full, as the scheduler keeps it); XLA cannot see into a Pallas kernel, whose
bytes are those it declares (the pages its rows hold, models/kernels/tpu's paged attention).

On v5e it compiles twice. XLA's "bytes accessed" counts each prefetch of an operand into VMEM
(memory-space assignment) as a read and a write, on top of the consumer's read, so the second
compile turns those prefetches off: that figure is nearer the HBM traffic. It still over-counts
gathers: alone, a gather of 64 rows from a 576 MB table on v5e is counted as 1169 MB.

Measured (GPT-OSS-20B on v5e:2x4, configs/gptoss_v5e.py, without VMEM prefetches; the command of
docs/benchmarks/paged-engine.md's round 9): at 256 rows and a pool of 2.5 GiB, 9.07 GB against a
floor of 7.92 GB (1.145x); at the shipped pool of 6 GiB, 12.83 GB against 11.68 GB (1.10x).
"""

import importlib.util
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jax.experimental import topologies

from models.registry import Model
from runner.engine import sampling
from runner.engine.build import build_engine
from runner.settings import from_config
from runner.tools.memory import footprint
from sharding.mesh import make_mesh
from sharding.rules import Rules

sampling.UNROLL_PASSES = True  # the cost analysis counts a loop's body once: every pass counted


def load_config(path: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def with_overrides(path: str, *overrides: str):
    """The config at `path` with `section.key=value` overrides applied."""
    c = load_config(path)
    for o in overrides:
        key, value = o.split("=", 1)
        section, name = key.split(".")
        old = c[section][name]
        c[section][name] = value == "True" if isinstance(old, bool) else type(old)(value)
    return c


def main(path: str, *overrides: str) -> None:
    c = with_overrides(path, *overrides)
    c.generation.steps_per_dispatch = 1  # the decode call of one step: a step's bytes, no loop
    s = from_config(c)
    if s.policy.scan_layers:  # XLA's cost analysis counts a loop's body once, not once per trip
        sys.exit("tpu_decode_bytes: programs.scan_layers=True puts the layers in a loop whose body "
                 "the cost analysis counts once; measure the unrolled program")
    topo = topologies.get_topology_desc(platform="tpu", topology_name=s.tpu_topology)
    model = Model.named(s.checkpoint_model)
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    engine = build_engine(s, model, model.abstract_params(rules, s.policy), rules, allocate=False)
    lowered = engine.lower()["decode_1"]
    f = footprint(s, model)
    floor = f.weights + f.kv_cache
    print(f"{s.checkpoint_model} on {s.tpu_topology}: floor {floor / 1e9:.2f} GB per chip per step "
          f"(weights {f.weights / 2**30:.2f} GiB + KV pool, every page held {f.kv_cache / 2**30:.2f} GiB)")
    runs = [("as deployed", {})]
    if s.tpu_topology.startswith("v5e"):  # v5e's flag for XLA's prefetches into VMEM
        runs.append(("no VMEM prefetch", {"xla_vf_vmem_memory_space_assignment": False}))
    for name, options in runs:
        t = time.time()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"  {name:<17} compiled in {time.time() - t:3.0f} s: temporaries "
              f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB, "
              f"{cost['bytes accessed'] / 1e9:.2f} GB accessed, {cost['bytes accessed'] / floor:.3f}x the floor")


if __name__ == "__main__":
    main(*sys.argv[1:])
