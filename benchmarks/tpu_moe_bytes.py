"""Per-chip HBM traffic of one layer's mixture of experts in a TPU deployment, from XLA's AOT cost
analysis, against the bytes of the layer's experts a chip holds (what a step must read).

    JAX_PLATFORMS=cpu python benchmarks/tpu_moe_bytes.py configs/gptoss_v5e.py TOKENS [section.key=value ...]

Compiles `gptoss.moe_block` of one layer alone, for TOKENS decode tokens ([TOKENS, 1, D] as the
decode step gives them), with the deployment's rules and shardings, for the config's
mesh.tpu_topology (libtpu needed), with XLA's VMEM prefetches off as benchmarks/tpu_decode_bytes.py
measures. A conditional is counted as its costlier branch. A Pallas kernel's bytes are the ones it
declares.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
from jax.experimental import topologies

from models import gptoss
from models.registry import Model
from runner.settings import from_config
from sharding.mesh import make_mesh
from sharding.rules import Rules
from tpu_decode_bytes import with_overrides


def measure(path: str, tokens: int, *overrides: str) -> tuple[float, float]:
    """(bytes accessed per chip, the experts' bytes per chip) of one layer's moe_block."""
    s = from_config(with_overrides(path, *overrides))
    topo = topologies.get_topology_desc(platform="tpu", topology_name=s.tpu_topology)
    model = Model.named(s.checkpoint_model)
    rules = Rules.make(make_mesh(s.mesh, topo.devices), s.rules)
    policy = s.policy.on(rules)
    layer = model.abstract_params(rules, s.policy)["layers"][0]
    x = jax.ShapeDtypeStruct((tokens, 1, model.config.hidden_size), policy.dtype,
                             sharding=rules.sharding("batch", "seq", "act_embed"))

    def run(p, x):
        return gptoss.moe_block(p, x, model.config, rules, policy)

    experts = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                  for n, a in layer.items() if n in gptoss.EXPERT_AXES or n == "w_down_rows")
    compiled = jax.jit(run).lower(layer, x).compile(
        compiler_options={"xla_vf_vmem_memory_space_assignment": False})
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"]), float(experts)


def main(path: str, tokens: str, *overrides: str) -> None:
    t = time.time()
    accessed, experts = measure(path, int(tokens), *overrides)
    print(f"moe_block, {tokens} tokens: compiled in {time.time() - t:.0f} s, {accessed / 1e6:.1f} MB "
          f"accessed per chip against the experts' {experts / 1e6:.1f} MB ({accessed / experts:.3f}x)")


if __name__ == "__main__":
    main(*sys.argv[1:])
