"""Ahead-of-time compilation for a deployment's TPU topology, on a machine with no TPU.

    python -m runner.tools.compile --config=configs/gptoss_v5e.py

Builds the config's mesh over libtpu's description of `mesh.tpu_topology` (e.g. v5e:2x4; one slice,
times the slices that mesh.dcn asks for), lowers and compiles against abstract weights the mixed
step of every chunk bucket and the decode call (and the variants a request compiles when it asks
for log-probabilities), and prints per-chip memory (weights, KV cache, temporaries) against the
chip's HBM and the step's flops and bytes accessed from XLA's cost analysis. Needs libtpu (`pip install libtpu==0.0.42.1`, the version
jax[tpu] 0.10.2 pins); JAX itself stays on CPU (JAX_PLATFORMS=cpu is set here when unset).

XLA's cost analysis counts the body of a loop once: the decode figures are one decode step's (the
body of the steps-per-dispatch loop).

It also compiles `update_weights`: the move of a trainer's weights, FSDP-sharded over every chip
(each weight split along its first dimension the chip count divides), onto the deployment's
shardings, as runner.generator.Generator.update_weights asks XLA for them; its time is the bytes
each chip receives over the chip's ICI bandwidth (ICI_GBPS), at most.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # topology descriptions only, no chips

import jax
from absl import app
from jax.experimental import topologies

from models.registry import Model
from runner.checkpoints.store import flatten
from runner.cli import config_flag
from runner.engine import Engine
from runner.engine.build import build_engine
from runner.settings import Settings, from_config
from runner.tools.memory import GiB, footprint
from sharding.mesh import make_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # a flag of this command only, so the module can be imported
    _CONFIG = config_flag()


@dataclasses.dataclass(frozen=True)
class Compiled:
    name: str
    argument_bytes: int  # per chip: weights + cache + inputs
    temp_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse donated inputs (the cache)
    flops: float  # per call, the whole program
    bytes_accessed: float
    error: str = ""  # XLA's reason when the program does not fit the chip (then all else is 0)

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes


def xla_cost(analysis, devices: int = 1) -> tuple[float, float]:
    """(flops, bytes accessed) of XLA's cost analysis (a dict, or a list of one), over `devices`."""
    cost = analysis[0] if isinstance(analysis, list) else analysis
    return cost.get("flops", 0.0) / devices, cost.get("bytes accessed", 0.0) / devices


# ICI bandwidth per chip, GB/s: v5e 1,600 Gbps, v5p 4,800 Gbps, v4 2,400 Gbps (Google's specs)
ICI_GBPS = {"v5e": 200.0, "v5litepod": 200.0, "v5p": 600.0, "v4": 300.0, "v6e": 448.0}


def fsdp(rules: Rules, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    """A trainer's FSDP layout of a weight: split along its first dimension that the mesh's chip
    count divides, over every mesh axis; replicated when none does."""
    axes = tuple(rules.mesh.axis_names)
    spec = [None] * len(shape)
    for i, d in enumerate(shape):
        if d % rules.mesh.size == 0:
            spec[i] = axes
            break
    return jax.sharding.NamedSharding(rules.mesh, jax.sharding.PartitionSpec(*spec))


def compile_update(s: Settings, model: Model, rules: Rules) -> Compiled:
    """The move of every weight (the checkpoint's names, shapes and precision.params) from an
    FSDP layout (fsdp) onto the shardings the deployment declares, a weight at a time as
    Generator.update_weights moves them, compiled (one program a shape): the bytes of them all,
    the temporaries of the largest."""
    dtype = jax.numpy.dtype(s.policy.params)
    shapes = collections.Counter((w.shape, w.axes) for w in flatten(model.declare()).values())
    total = collections.Counter()
    for (shape, axes), count in shapes.items():
        move = jax.jit(lambda x: x, out_shardings=rules.sharding(*axes))
        c = move.lower(jax.ShapeDtypeStruct(shape, dtype, sharding=fsdp(rules, shape))).compile()
        m = c.memory_analysis()
        total.update(argument=count * m.argument_size_in_bytes, output=count * m.output_size_in_bytes,
                     accessed=count * xla_cost(c.cost_analysis())[1])
        total["temp"] = max(total["temp"], m.temp_size_in_bytes)
    return Compiled("update_weights", total["argument"], total["temp"], total["output"], 0, 0.0,
                    total["accessed"])


def compile_deployment(s: Settings, model: Model | None = None, only: tuple[str, ...] = (),
                       variants: bool = False) -> tuple[Engine, dict[str, Compiled]]:
    """Compiles for s.tpu_topology the engine the job builds (build_engine); the model is
    checkpoint.model's preset unless given. `only` names the programs to compile (e.g.
    "mixed_256", "decode_8"); () compiles them all. variants: also those that compile only when a
    request asks for them (log-probabilities; Engine.lower)."""
    if not s.tpu_topology:
        raise ValueError("the config sets no mesh.tpu_topology (e.g. v5e:2x4) to compile for")
    if model is None and not s.checkpoint_model:
        raise ValueError("the config sets no checkpoint.model (family:preset) to compile")
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=s.tpu_topology,
                                            num_slices=math.prod(s.mesh.dcn))
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError is a RuntimeError
        raise ValueError(f"mesh.tpu_topology={s.tpu_topology!r}: no TPU topology description "
                         f"({str(e).splitlines()[0]}); is libtpu installed (pip install "
                         "libtpu==0.0.42.1), and is the name like v5e:2x4?") from e
    model = model or Model.named(s.checkpoint_model)
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    engine = build_engine(s, model, model.abstract_params(rules, s.policy), rules, allocate=False)
    programs = engine.lower(variants)
    if unknown := sorted(set(only) - set(programs)):
        raise ValueError(f"no program {unknown} to compile; this deployment has {sorted(programs)}")
    out = {}
    for name in only or programs:
        try:
            c = programs[name].compile()
        except jax.errors.JaxRuntimeError as e:  # XLA:TPU refuses a program that cannot fit
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            out[name] = Compiled(name, 0, 0, 0, 0, 0.0, 0.0, error=str(e).strip().splitlines()[0])
            continue
        m = c.memory_analysis()
        out[name] = Compiled(name, m.argument_size_in_bytes, m.temp_size_in_bytes,
                             m.output_size_in_bytes, m.alias_size_in_bytes, *xla_cost(c.cost_analysis()))
    if variants and not only:
        out["update_weights"] = compile_update(s, model, rules)
    return engine, out


def report(s: Settings, engine: Engine, compiled: dict[str, Compiled]) -> str:
    f = footprint(s, engine.model)
    hbm, L = f.device_memory, engine.layout
    w = max([len("program")] + [len(c.name) for c in compiled.values()]) + 2
    pages = f"{L.pages} + {L.window_pages} window" if L.window_pages else f"{L.pages}"
    lines = [f"{s.checkpoint_model} on {s.tpu_topology} ({f.devices} chips, mesh {dict(engine.rules.mesh.shape)}), "
             f"batch {L.batch_size}, pool of {pages} pages x {L.page_size} tokens per group:",
             f"  declared per chip: weights {f.weights / GiB:.2f} GiB, KV cache {f.kv_cache / GiB:.2f} GiB",
             f"  {'program':<{w}}{'args GiB':>10}{'temp GiB':>10}{'peak GiB':>10}{'of HBM':>8}"
             f"{'GFLOP':>12}{'GB accessed':>13}"]
    for c in compiled.values():
        if c.error:
            lines.append(f"  {c.name:<{w}}does not fit: {c.error.removeprefix('RESOURCE_EXHAUSTED: ')}")
            continue
        share = f"{100 * c.peak_bytes / hbm:.0f}%" if hbm else "?"
        lines.append(f"  {c.name:<{w}}{c.argument_bytes / GiB:>10.2f}{c.temp_bytes / GiB:>10.2f}"
                     f"{c.peak_bytes / GiB:>10.2f}{share:>8}{c.flops / 1e9:>12.1f}{c.bytes_accessed / 1e9:>13.2f}")
    lines.append(f"  GFLOP and GB accessed per chip, a loop's body counted once: decode per step "
                 f"({L.steps} per call), mixed per call (the rows' next tokens and a chunk of up to "
                 f"{L.chunk} prompt tokens)")
    update = compiled.get("update_weights")
    ici = ICI_GBPS.get(s.tpu_topology.split(":")[0])
    if update is not None and not update.error and ici:
        # the trainer's copy, the new weights and the largest move's temporaries (the old
        # weights are freed first), beside the KV pool unless it is released first
        of = lambda b: f"{b / GiB:.2f} GiB" + (f" ({100 * b / hbm:.0f}% of HBM)" if hbm else "")
        lines.append(f"  update_weights from FSDP, a weight at a time: {update.output_bytes / 1e9:.2f}"
                     f" GB a chip received, at most {update.output_bytes / 1e9 / ici:.2f} s over "
                     f"{ici:.0f} GB/s of ICI; {of(update.peak_bytes)} with the trainer's copy, "
                     f"{of(update.peak_bytes + f.kv_cache)} beside the KV pool "
                     "(Generator.release() hands the pool back first)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    try:  # a bad config, mesh, rule or topology is one line (all are ValueErrors here)
        s = from_config(_CONFIG.value)
        engine, compiled = compile_deployment(s, variants=True)
    except ValueError as e:
        sys.exit(f"podrun compile: error: {e}")
    print(report(s, engine, compiled))
    too_big = [c.name for c in compiled.values()
               if c.error or s.device_memory_gib and c.peak_bytes > s.device_memory_gib * GiB]
    if too_big:
        sys.exit(f"podrun compile: error: {too_big} do not fit {s.device_memory_gib} GiB per chip")


if __name__ == "__main__":
    app.run(main)
