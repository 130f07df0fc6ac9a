"""The kernels a mesh runs, chosen once per mesh: podrun's C++ kernels on CPU (models/kernels/cpu.py),
the Pallas kernels on TPU (models/kernels/tpu.py), cuDNN's prefill attention and a Pallas (Triton)
decode attention on NVIDIA GPUs (models/kernels/gpu.py), and XLA for everything else. The models
and the engine ask their policy's Backend (models/policy.Policy.on); none of them tests the
platform.

What a Backend says holds for every call on its mesh. A kernel may still decline a call whose
operands it does not take (a dtype, a row count, a query count); those checks stay
with the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Backend:
    platform: str = "cpu"  # cpu | gpu | tpu: where the mesh's devices are

    # CPU, with kernels.enabled and a C++ compiler (without one: a warning, and XLA):
    product_kernel: bool = False  # float32 products and rms_norm of a decode step's rows: one device
    quant_kernels: bool = False  # the int8 and int4 products
    attention_kernel: bool = False  # attention of a decode step's few queries, or of a prompt
    panels: bool = False  # float32 projections held in column panels (models/panels.py)
    greedy_screen: bool = False  # greedy tokens through an int8 screen of a float32 unembedding
    huge_pages: bool = False  # weights and KV cache on 2 MiB pages (runner/engine/hugepages.py)
    # A decode step's attention in Pallas (kernels.pallas_attention): "tpu" (Mosaic) or "gpu"
    # (Triton), or "" (XLA's attention)
    pallas_decode: str = ""
    # TPU:
    ragged_experts: bool = False  # GPT-OSS's experts as ragged groups of megablox' gmm
    row_major_tables: bool = False  # lookup tables pinned row-major (models/weights.py)
    # A prompt's attention over its own keys in a flash kernel: "pallas" (TPU), "cudnn" (NVIDIA;
    # not with attention sinks) or "" (XLA's attention)
    flash_prefill: str = ""
    # TPU: the paged engine's cache writes and attention in Pallas, over pools stored folded
    # (models/paged.py, models/kernels/tpu.py); int8 pools stay XLA's
    pallas_paged: bool = False
    # What one more step of the paged engine costs, in prompt tokens computed: on TPU and GPU a
    # step reads every weight from HBM, worth hundreds of tokens' flops, so a prompt's last chunk
    # is padded up to a bucket rather than split; on CPU a step's own cost is a few tokens', so a
    # prompt is split into buckets it fills (runner/engine/paged_scheduler.py's chunk plan).
    step_tokens: int = 256

    @classmethod
    def resolve(cls, policy: Any, rules: Rules) -> Backend:
        """The backend of `policy`'s kernel switches (precision.*) on `rules`' mesh."""
        platform = rules.platform
        unsplit_cache = rules.shards("cache_seq") == 1  # the attention kernels take whole rows
        pallas_decode = policy.kernels and policy.pallas_attention and unsplit_cache
        if platform == "cpu":
            from models.kernels import cpu

            on = policy.kernels and cpu.available()
            alone = on and rules.mesh.size == 1
            f32 = policy.dtype.name == "float32" and policy.params == "float32"
            return cls(platform, product_kernel=alone, quant_kernels=on,
                       attention_kernel=on and unsplit_cache,
                       panels=alone and policy.panel_weights and f32 and policy.quantize == "none",
                       greedy_screen=alone and policy.greedy_screen and policy.dtype.name == "float32",
                       huge_pages=policy.huge_pages, step_tokens=16)
        if platform == "tpu":
            return cls(platform, pallas_decode="tpu" if pallas_decode else "",
                       ragged_experts=policy.pallas_moe, row_major_tables=True,
                       flash_prefill="pallas" if policy.pallas_prefill and unsplit_cache else "",
                       pallas_paged=policy.kernels and unsplit_cache)
        return cls(platform, pallas_decode="gpu" if pallas_decode else "",
                   flash_prefill="cudnn" if policy.cudnn_prefill and unsplit_cache else "")

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """XLA options for the engine's programs. On CPU, region analysis in copy insertion: a layer's
        cache is read (attention) and then written in place, and without it XLA:CPU copies the
        whole cache on every step."""
        return {"xla_cpu_copy_insertion_use_region_analysis": True} if self.platform == "cpu" else None
