"""Bytes per device of a deployment's weights and KV cache, from the declarations alone.

    python -m runner.tools.memory --config=configs/gptoss_v5e.py

Nothing is allocated: shapes come from the model's weight declarations (checkpoint.model) and the
engine's cache, their shards from the config's mesh and rules.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import numpy as np
from absl import app
from ml_collections import config_flags

from models import quant
from models.kv_cache import KVCache
from models.registry import Model
from models.weights import check_divisible, is_weight
from runner.settings import Settings, from_config
from sharding.mesh import abstract_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # a flag of this command only, so the module can be imported
    _CONFIG = config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Footprint:
    devices: int
    weights: int  # bytes on the busiest device
    kv_cache: int
    total_weights: int  # bytes over all devices, replicas included once
    device_memory: int  # 0 = unknown
    prefix_pool: int = 0  # the prefix pool's keys and values (generation.prefix_tokens)

    @property
    def per_device(self) -> int:
        return self.weights + self.kv_cache + self.prefix_pool


def _shard_bytes(shape, axes, rules: Rules, itemsize: int) -> int:
    return math.prod(math.ceil(n / rules.shards(a)) for n, a in zip(shape, axes)) * itemsize


def footprint(s: Settings, model: Model) -> Footprint:
    devices = s.mesh.size() or s.num_cpu_devices
    if not devices:
        raise ValueError("mesh has a -1 axis and no num_cpu_devices: cannot tell the device count")
    rules = Rules.make(abstract_mesh(s.mesh, devices), s.rules)
    decl = model.declare()
    check_divisible(decl, rules)
    weights = jax.tree.leaves(decl, is_leaf=is_weight)
    p_size = np.dtype(s.policy.params).itemsize
    q = s.policy.quantize
    # int8 and its scales shard like the weight: each element's bytes times its shard's share
    w_bytes = sum(_shard_bytes(w.shape, w.axes, rules, 1) * quant.stored_bytes(w, p_size, q)
                  // math.prod(w.shape) for w in weights)
    total = sum(quant.stored_bytes(w, p_size, q) for w in weights)
    g = s.generation
    data = rules.shards("batch")
    batch = -(-g.batch_size // data) * data
    length = max(g.prefill_buckets or (g.max_prompt_len,)) + g.max_new_tokens
    windows, kv_heads, head_dim = model.module.cache_spec(model.config)
    c_size = KVCache.bytes_per_element(s.policy.kv_cache, head_dim)
    axes = ("cache_batch", "cache_kv_heads", "cache_seq", None)
    kv = sum(int(2 * _shard_bytes((batch, kv_heads, n, head_dim), axes, rules, 1) * c_size)
             for n in KVCache.lengths(length, windows))
    pool = 0  # as runner/engine keeps it: blocks as rows of prefix_block columns, every layer
    if g.prefix_tokens >= g.prefix_block > 0:
        blocks = g.prefix_tokens // g.prefix_block
        pool = len(windows) * int(2 * _shard_bytes((blocks, kv_heads, g.prefix_block, head_dim),
                                                   axes, rules, 1) * c_size)
    return Footprint(devices, w_bytes, kv, total, int(s.device_memory_gib * GiB), pool)


def describe(f: Footprint, model: Model) -> str:
    lines = [
        f"model {model.family} ({f.total_weights / GiB:.2f} GiB of weights in all) on {f.devices} devices:",
        f"  weights   {f.weights / GiB:8.3f} GiB per device",
        f"  KV cache  {f.kv_cache / GiB:8.3f} GiB per device",
        *([f"  prefixes  {f.prefix_pool / GiB:8.3f} GiB per device (generation.prefix_tokens)"]
          if f.prefix_pool else []),
        f"  total     {f.per_device / GiB:8.3f} GiB per device",
    ]
    if f.device_memory:
        verdict = "fits" if f.per_device <= f.device_memory else "DOES NOT FIT"
        lines.append(f"  device memory {f.device_memory / GiB:.1f} GiB: {verdict} "
                     f"({100 * f.per_device / f.device_memory:.0f}% before activations and temporaries)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    s = from_config(_CONFIG.value)
    if not s.checkpoint_model:
        sys.exit("podrun memory: error: the config sets no checkpoint.model (family:preset) to size")
    model = Model.named(s.checkpoint_model)
    print(describe(footprint(s, model), model))


if __name__ == "__main__":
    app.run(main)
