"""Bytes per device of a deployment's weights and KV cache, from the declarations alone.

    python -m runner.tools.memory --config=configs/gptoss_v5e.py [--mean_tokens=3000]

Nothing is allocated: shapes come from the model's weight declarations (checkpoint.model) and the
engine's cache, their shards from the config's mesh and rules. The unpaged engine's cache is
batch_size rows of max_prompt_len + max_new_tokens slots (a window's ring on sliding-window
layers); the paged engine's (generation.page_size > 0) is its page pool, a device holding its
group's pages. --mean_tokens=L also reports how many rows the KV memory admits when a request
holds L tokens on average (paged) or, unpaged, how many rows fit at their worst case.
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
from models.paged import PagedCache
from models.registry import Model
from models.weights import check_divisible, is_weight
from runner.settings import Settings, from_config
from sharding.mesh import abstract_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # a flag of this command only, so the module can be imported
    from absl import flags

    _CONFIG = config_flags.DEFINE_config_file("config", None, "deployment config file", lock_config=True)
    _MEAN_TOKENS = flags.DEFINE_integer(
        "mean_tokens", 0, "also report the rows the KV memory admits when requests hold this many "
        "tokens (prompt and generated) on average; 0: not shown")
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Footprint:
    devices: int
    weights: int  # bytes on the busiest device
    kv_cache: int
    total_weights: int  # bytes over all devices, replicas included once
    device_memory: int  # 0 = unknown
    prefix_pool: int = 0  # the prefix pool's keys and values (generation.prefix_tokens)
    batch_size: int = 0  # rows, rounded up to a multiple of the batch's shards
    data_shards: int = 1  # the batch's shards: the paged engine's groups
    row_kv: int = 0  # unpaged: the bytes one row's cache takes on a device, at its longest
    page_size: int = 0  # paged (> 0): tokens a page holds; 0: the unpaged engine
    pages: int = 0  # paged: the pool's pages per group (kv_cache is pages x page_bytes)
    page_bytes: int = 0  # paged: one page of every layer on a device

    @property
    def per_device(self) -> int:
        return self.weights + self.kv_cache + self.prefix_pool

    @property
    def free(self) -> int:
        """Device memory beside the weights (and the unpaged engine's prefix pool)."""
        return self.device_memory - self.weights - self.prefix_pool

    def worst_case_rows(self) -> int:
        """Unpaged: the rows whose caches, each of its longest request, fit in device memory
        beside the weights and prefix pool, over all data shards."""
        return max(0, self.free // self.row_kv) * self.data_shards if self.row_kv else 0

    def pages_per_row(self, mean_tokens: int) -> int:
        return -(-mean_tokens // self.page_size)

    def pool_rows(self, mean_tokens: int) -> int:
        """Paged: the rows the pool admits when each holds mean_tokens tokens (at most the
        batch)."""
        return min(self.batch_size, self.data_shards * (self.pages // self.pages_per_row(mean_tokens)))

    def memory_rows(self, mean_tokens: int) -> int:
        """Paged: the rows of mean_tokens tokens whose pages fit in device memory beside the
        weights, over all groups (whatever kv_cache_gib and batch_size say)."""
        return max(0, self.free // (self.pages_per_row(mean_tokens) * self.page_bytes)) * self.data_shards


def _shard_bytes(shape, axes, rules: Rules, itemsize: int) -> int:
    return math.prod(math.ceil(n / rules.shards(a)) for n, a in zip(shape, axes)) * itemsize


def page_bytes(s: Settings, model: Model, rules: Rules) -> int:
    """Bytes one page (generation.page_size tokens of every layer's keys and values) takes on a
    device: the paged engine's unit of KV memory."""
    _, kv_heads, head_dim = model.module.cache_spec(model.config)
    return PagedCache.page_bytes(model.num_layers, kv_heads, head_dim, s.generation.page_size,
                                 s.policy.kv_cache, rules)


def pool_pages(s: Settings, model: Model, rules: Rules) -> int:
    """The paged engine's pages per group (a device holds its group's): as many as
    generation.kv_cache_gib holds, or with 0 room for every row of the group at its longest
    (max_prompt_len + max_new_tokens), as PagedEngine gives for pages=0."""
    g = s.generation
    if g.kv_cache_gib:
        return int(g.kv_cache_gib * GiB // page_bytes(s, model, rules))
    groups = rules.shards("batch")
    rows = -(-g.batch_size // groups)
    return rows * -(-(g.max_prompt_len + g.max_new_tokens) // g.page_size)


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
    memory = int(s.device_memory_gib * GiB)
    if g.page_size:  # the page pool [G, P, K, S, H] per layer, G over cache_batch
        pages, page = pool_pages(s, model, rules), page_bytes(s, model, rules)
        groups = -(-data // rules.shards("cache_batch"))  # a device's groups: 1 by default
        return Footprint(devices, w_bytes, groups * pages * page, total, memory, 0, batch, data,
                         page_size=g.page_size, pages=pages, page_bytes=page)
    length = max(g.prefill_buckets or (g.max_prompt_len,)) + g.max_new_tokens
    windows, kv_heads, head_dim = model.module.cache_spec(model.config)
    c_size = KVCache.bytes_per_element(s.policy.kv_cache, head_dim)
    axes = ("cache_batch", "cache_kv_heads", "cache_seq", None)

    def cache(rows):
        return sum(int(2 * _shard_bytes((rows, kv_heads, n, head_dim), axes, rules, 1) * c_size)
                   for n in KVCache.lengths(length, windows))

    pool = 0  # as runner/engine keeps it: blocks as rows of prefix_block columns, every layer
    if g.prefix_tokens >= g.prefix_block > 0:
        blocks = g.prefix_tokens // g.prefix_block
        pool = len(windows) * int(2 * _shard_bytes((blocks, kv_heads, g.prefix_block, head_dim),
                                                   axes, rules, 1) * c_size)
    return Footprint(devices, w_bytes, cache(batch), total, memory, pool, batch,
                     rules.shards("cache_batch"), row_kv=cache(1))


def describe(f: Footprint, model: Model, mean_tokens: int = 0) -> str:
    """The report; mean_tokens > 0 adds the rows the KV memory admits (see the module's doc)."""
    pool = (f" (pool of {f.pages} pages x {f.page_size} tokens per group, "
            f"{f.page_bytes / 2**20:.3f} MiB a page)" if f.page_size else "")
    lines = [
        f"model {model.family} ({f.total_weights / GiB:.2f} GiB of weights in all) on {f.devices} devices:",
        f"  weights   {f.weights / GiB:8.3f} GiB per device",
        f"  KV cache  {f.kv_cache / GiB:8.3f} GiB per device{pool}",
        *([f"  prefixes  {f.prefix_pool / GiB:8.3f} GiB per device (generation.prefix_tokens)"]
          if f.prefix_pool else []),
        f"  total     {f.per_device / GiB:8.3f} GiB per device",
    ]
    if f.device_memory:
        verdict = "fits" if f.per_device <= f.device_memory else "DOES NOT FIT"
        lines.append(f"  device memory {f.device_memory / GiB:.1f} GiB: {verdict} "
                     f"({100 * f.per_device / f.device_memory:.0f}% before activations and temporaries)")
    if f.page_size:
        groups = f"{f.data_shards} group" + ("s" if f.data_shards > 1 else "")
        lines.append(f"  page pool {f.pages} pages per group, {f.pages * f.data_shards} in all "
                     f"({groups}): {f.pages * f.page_size} tokens per group, "
                     f"{f.pages * f.page_size * f.data_shards} in all")
    if mean_tokens and f.page_size:
        per = f.pages_per_row(mean_tokens)
        lines.append(f"  rows admitted at a mean of {mean_tokens} tokens ({per} pages a row): "
                     f"{f.pool_rows(mean_tokens)} of batch {f.batch_size} by the pool")
        if f.device_memory:
            lines.append(f"  rows admitted in device memory at a mean of {mean_tokens} tokens: "
                         f"{f.memory_rows(mean_tokens)} (pages beside the weights, all groups)")
    elif mean_tokens and f.device_memory:
        lines.append(f"  rows that fit in device memory at their worst case: {f.worst_case_rows()} "
                     f"({f.row_kv / 2**20:.2f} MiB a row per device beside the weights and prefix "
                     "pool, all data shards; unpaged rows reserve their longest request whatever "
                     "--mean_tokens)")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    s = from_config(_CONFIG.value)
    if not s.checkpoint_model:
        sys.exit("podrun memory: error: the config sets no checkpoint.model (family:preset) to size")
    model = Model.named(s.checkpoint_model)
    print(describe(footprint(s, model), model, _MEAN_TOKENS.value))


if __name__ == "__main__":
    app.run(main)
