"""Bytes per device of a deployment's weights and KV cache, from the declarations alone.

    python -m runner.tools.memory --config=configs/gptoss_v5e.py [--mean_tokens=3000]

Nothing is allocated: shapes come from the model's weight declarations (checkpoint.model) and the
engine's page pools (the full-attention layers', and the windowed layers' with room for every
row's window), their shards from the config's mesh and rules, a device holding its group's pages.
--mean_tokens=L also reports how many rows the KV memory admits when a request holds L tokens on
average.
"""

from __future__ import annotations

import dataclasses
import math
import sys

import jax
import numpy as np
from absl import app, flags

from models import quant
from models.registry import Model
from models.weights import check_divisible, is_weight
from runner.cli import config_flag
from runner.engine.engine import Pools, size_pools
from runner.settings import Settings, from_config
from sharding.mesh import abstract_mesh
from sharding.rules import Rules

if __name__ == "__main__":  # a flag of this command only, so the module can be imported
    _CONFIG = config_flag()
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
    batch_size: int = 0  # rows, rounded up to a multiple of the batch's shards
    data_shards: int = 1  # the batch's shards: the engine's groups
    # Per group, the full-attention layers' pool of `pages` and the windowed layers' of
    # `window_pages` (room for every row's window at once), a page's bytes on a device in each; a
    # row holds at most window_row_pages of the latter, and the longest request max_pages of the
    # former.
    page_size: int = 0
    pages: int = 0
    page_bytes: int = 0
    window_pages: int = 0
    window_page_bytes: int = 0
    window_row_pages: int = 0
    max_pages: int = 0

    @property
    def per_device(self) -> int:
        return self.weights + self.kv_cache

    def pages_per_row(self, mean_tokens: int) -> int:
        return -(-mean_tokens // self.page_size)

    def pool_rows(self, mean_tokens: int) -> int:
        """The rows the pool admits when each holds mean_tokens tokens (at most the
        batch; the window pool has room for every row)."""
        return min(self.batch_size, self.data_shards * (self.pages // self.pages_per_row(mean_tokens)))

    def row_bytes(self, mean_tokens: int) -> int:
        """A row's pages of mean_tokens tokens on a device, its window's included."""
        return (self.pages_per_row(mean_tokens) * self.page_bytes
                + self.window_row_pages * self.window_page_bytes)

    def memory_rows(self, mean_tokens: int) -> int:
        """The rows of mean_tokens tokens whose pages fit in device memory beside the
        weights, over all groups (whatever kv_cache_gib and batch_size say)."""
        free = self.device_memory - self.weights
        return max(0, free // self.row_bytes(mean_tokens)) * self.data_shards


def pools(s: Settings, model: Model, rules: Rules) -> Pools:
    """The engine's pools per group, sized by the Engine's own size_pools from generation.*
    (kv_cache_gib as runner/engine/build.py passes it); tests/test_compile.py checks they agree."""
    g = s.generation
    max_len = g.max_prompt_len + g.max_new_tokens
    steps = max(1, min(g.steps_per_dispatch, g.max_new_tokens))  # as the Engine's decode call
    reach = max(min(g.chunk_tokens, max_len), steps)  # its largest chunk bucket, or its steps
    return size_pools(model, rules, s.policy.kv_cache, -(-g.batch_size // rules.shards("batch")),
                      max_len, g.page_size, reach, int(g.kv_cache_gib * GiB))


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
    shard = lambda w: math.prod(-(-n // rules.shards(a)) for n, a in zip(w.shape, w.axes))
    w_bytes = sum(shard(w) * quant.stored_bytes(w, p_size, q) // math.prod(w.shape)
                  for w in weights)
    total = sum(quant.stored_bytes(w, p_size, q) for w in weights)
    g = s.generation
    data = rules.shards("batch")
    batch = -(-g.batch_size // data) * data
    memory = int(s.device_memory_gib * GiB)
    # the page pools [G, P, K, S, H] per layer, G over cache_batch
    p = pools(s, model, rules)
    groups = -(-data // rules.shards("cache_batch"))  # a device's groups: 1 by default
    return Footprint(devices, w_bytes, groups * p.bytes, total, memory, batch, data,
                     page_size=g.page_size, pages=p.pages, page_bytes=p.page_bytes,
                     window_pages=p.window_pages, window_page_bytes=p.window_page_bytes,
                     window_row_pages=p.window_row_pages,
                     max_pages=-(-(g.max_prompt_len + g.max_new_tokens) // g.page_size))


def describe(f: Footprint, model: Model, mean_tokens: int = 0) -> str:
    """The report; mean_tokens > 0 adds the rows the KV memory admits (see the module's doc)."""
    pages = f"{f.pages} + {f.window_pages} window" if f.window_pages else f"{f.pages}"
    pool = f" (pool of {pages} pages x {f.page_size} tokens per group)"
    lines = [
        f"model {model.family} ({f.total_weights / GiB:.2f} GiB of weights in all) on {f.devices} devices:",
        f"  weights   {f.weights / GiB:8.3f} GiB per device",
        f"  KV cache  {f.kv_cache / GiB:8.3f} GiB per device{pool}",
        f"  total     {f.per_device / GiB:8.3f} GiB per device",
    ]
    if f.device_memory:
        verdict = "fits" if f.per_device <= f.device_memory else "DOES NOT FIT"
        lines.append(f"  device memory {f.device_memory / GiB:.1f} GiB: {verdict} "
                     f"({100 * f.per_device / f.device_memory:.0f}% before activations and temporaries)")
    groups = f"{f.data_shards} group" + ("s" if f.data_shards > 1 else "")
    lines.append(f"  page pool {f.pages} pages per group, {f.pages * f.data_shards} in all "
                 f"({groups}): {f.pages * f.page_size} tokens per group, "
                 f"{f.pages * f.page_size * f.data_shards} in all "
                 f"({f.page_bytes / 2**20:.3f} MiB a page of the full-attention layers)")
    if f.window_pages:
        lines.append(f"  window pool {f.window_pages} pages per group, {f.window_row_pages} a "
                     f"row ({f.window_page_bytes / 2**20:.3f} MiB a page of the windowed layers)")
    if f.pages < f.max_pages:
        lines.append(f"  the pool holds fewer pages than the {f.max_pages} of one request of "
                     "max_prompt_len + max_new_tokens: the engine refuses it (raise kv_cache_gib)")
    if mean_tokens:
        per = f.pages_per_row(mean_tokens)
        window = f", + {f.window_row_pages} window pages" if f.window_row_pages else ""
        lines.append(f"  rows admitted at a mean of {mean_tokens} tokens ({per} pages a row{window}): "
                     f"{f.pool_rows(mean_tokens)} of batch {f.batch_size} by the pool")
        if f.device_memory:
            lines.append(f"  rows admitted in device memory at a mean of {mean_tokens} tokens: "
                         f"{f.memory_rows(mean_tokens)} ({f.row_bytes(mean_tokens) / 2**20:.2f} "
                         "MiB a row per device beside the weights, all groups)")
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
