"""Per-chip HBM traffic of a decode step's sampler alone, from XLA's AOT cost analysis (VMEM
prefetches off, as benchmarks/tpu_decode_bytes.py's second figure).

    JAX_PLATFORMS=cpu python benchmarks/tpu_sampler_bytes.py configs/gptoss_v5e.py [ROWS [PART ...]]

Compiles, for the config's mesh.tpu_topology, what the step does after the final norm: the
unembedding of ROWS hidden states (256 unless given) into logits split over the vocabulary as the
deployment's rules split them, then PART of the sampler:
  unembed  the logits and their greedy tokens alone (what a greedy step must spend)
  sample   runner.engine.sampling.sample, as the step runs it (the default); the cost analysis
           counts each lax.cond as its costliest branch
  a string of T and F, e.g. TF: sample with its lax.conds, in the order it traces them, replaced by
           their true (T) or false (F) branch alone: one branch's cost (TF: the sampled rows'
           candidates alone, TT: with the whole-vocabulary branch; those left over stay conds)
The figures include the unembedding's weights (V x D bf16 over the chips), printed apart.

Measured (GPT-OSS-20B on v5e:2x4, configs/gptoss_v5e.py, 256 rows): unembed 172.5 MB, sample
371.9 MB, whose costliest way is a nucleus past the candidates (docs/benchmarks/paged-engine.md).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from models.registry import Model
from runner.engine import sampling
from runner.settings import from_config
from sharding.mesh import make_mesh
from sharding.rules import Rules
from tpu_decode_bytes import load_config  # benchmarks/, this script's folder

sampling.UNROLL_PASSES = True  # the cost analysis counts a loop's body once: every pass counted


def part(name: str):
    """PART -> f(logits, seeds, counts, temperature, top_k, top_p) -> tokens."""
    if name == "unembed":
        return lambda logits, *_: sampling.greedy_tokens(logits.astype(jnp.float32))
    if name == "sample":
        return sampling.sample
    if set(name) - set("TF"):
        sys.exit(f"tpu_sampler_bytes: PART {name!r} is none of unembed, sample, or a string of T, F")

    def f(*args):
        taken = list(name)
        real = jax.lax.cond

        def cond(pred, true, false, *operands):
            if not taken:
                return real(pred, true, false, *operands)
            return (true if taken.pop(0) == "T" else false)(*operands)

        jax.lax.cond = cond
        try:
            return sampling.sample(*args)
        finally:
            jax.lax.cond = real
    return f


def main(path: str, rows: str = "256", *names: str) -> None:
    B = int(rows)
    s = from_config(load_config(path))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=s.tpu_topology)
    model = Model.named(s.checkpoint_model)
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    u = model.unembedding(model.abstract_params(rules, s.policy))
    weights = u.w.size * u.w.dtype.itemsize / rules.mesh.size
    D = u.w.shape[1] if u.vocab_first else u.w.shape[0]
    rows_sh = rules.sharding("batch", shape=(B,))
    hidden = jax.ShapeDtypeStruct((B, D), s.policy.activations, sharding=rules.sharding(
        "batch", "act_embed", shape=(B, D)))
    row = lambda dtype: jax.ShapeDtypeStruct((B,), dtype, sharding=rows_sh)
    args = (hidden, row(jnp.uint32), row(jnp.int32), row(jnp.float32), row(jnp.int32),
            row(jnp.float32))
    print(f"{s.checkpoint_model} on {s.tpu_topology}, {B} rows: unembedding {weights / 1e6:.1f} MB "
          f"a chip, logits {B * u.w.shape[0] * 4 / rules.mesh.size / 1e6:.1f} MB a chip in float32")
    for name in names or ("sample",):
        f = part(name)

        def step(w, h, *rest, f=f):
            logits = u._replace(w=w).logits(h[:, None], rules, s.policy)[:, 0]
            return f(logits, *rest)

        lowered = jax.jit(step).lower(u.w, *args)
        compiled = lowered.compile(compiler_options={"xla_vf_vmem_memory_space_assignment": False})
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        print(f"  {name:<11} {cost['bytes accessed'] / 1e6:8.1f} MB accessed, "
              f"{(cost['bytes accessed'] - weights) / 1e6:8.1f} MB besides the weights, temporaries "
              f"{compiled.memory_analysis().temp_size_in_bytes / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
