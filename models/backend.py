"""The kernels a mesh runs, chosen once per mesh: podrun's C++ kernels on CPU (models/kernels/cpu.py),
the Pallas kernels on TPU (models/kernels/tpu/), Pallas (Triton) attention over pages on NVIDIA
GPUs (models/kernels/gpu.py), and XLA for everything else.

`Backend.resolve` reads the config's switches (kernels.*) once per mesh. The models and the engine
then ask their policy's Backend for the kernel of an operation (`paged_attention`, `write_pages`,
`matmul_f32`, ...): it hands back the function to call, or None where XLA's
path runs. None of them imports a kernel module or tests the platform. A kernel that declines
some calls (a dtype, a row count, a query count) says so here, where it is chosen: the caller
passes the operands it has.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.kernels import cpu
from sharding.rules import Rules

# A decode step's rows, at most, that podrun's CPU product kernel takes: XLA:CPU's dot runs a
# decode step's small products on one thread, where the kernel splits each over threads that spin
# between products; a prefill's many rows (the kernel reads W once per 8 rows) go faster in XLA.
PRODUCT_KERNEL_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Backend:
    platform: str = "cpu"  # cpu | gpu | tpu: where the mesh's devices are

    # CPU, with kernels.enabled and a C++ compiler (without one: a warning, and XLA):
    product_kernel: bool = False  # float32 products and rms_norm of a decode step's rows: one device
    quant_kernels: bool = False  # the int8 and int4 products
    # From this many rows on, the int4 product rounds x and W to bfloat16 (AVX-512 BF16, with
    # precision.int4_activations=bfloat16); 0: float32 whatever the rows
    int4_bf16_rows: int = 0
    # Batch invariance (precision.batch_invariant): the product and norm kernels take a step's
    # rows whatever their number, and int4's products round to bfloat16 from one row, so that a
    # row's numbers are the same bits whatever runs beside it (docs/batch-invariance.md)
    any_rows: bool = False
    attention_kernel: bool = False  # attention over the page pools
    panels: bool = False  # float32 projections held in column panels (models/panels.py)
    int8_screen: bool = False  # greedy tokens through an int8 screen of a float32 unembedding
    huge_pages: bool = False  # weights and KV cache on 2 MiB pages (runner/engine/hugepages.py)
    # TPU:
    ragged_experts: bool = False  # GPT-OSS's experts as ragged groups of megablox' gmm
    # VMEM that GPT-OSS's experts kernel may take (models/kernels/tpu.experts: a step's experts in
    # one Pallas kernel, their down projection held [E, F, D] by models/gptoss.for_backend; bf16 or
    # f32 experts on v5e and v6e); 0: XLA's experts
    experts_vmem: int = 0
    row_major_tables: bool = False  # lookup tables pinned row-major (models/weights.py)
    # The engine's kernels over pages: "tpu" (kernels.enabled), its cache writes and attention in
    # Pallas (Mosaic) over pools stored folded (models/paged.py, models/kernels/tpu/; int8 pools
    # stay XLA's); "gpu" (kernels.pallas_attention), its attention in Pallas (Triton) over any
    # pool (models/kernels/gpu.py), the writes XLA's scatter; "": XLA's attention, whose blocks
    # read every row of a step as far as its longest
    pallas_paged: str = ""
    # What one more step of the engine costs, in prompt tokens computed: on TPU and GPU a
    # step reads every weight from HBM, worth hundreds of tokens' flops, so a prompt's last chunk
    # is padded up to a bucket rather than split; on CPU a step's own cost is a few tokens', so a
    # prompt is split into buckets it fills (runner/engine/scheduler.py's chunk plan).
    step_tokens: int = 256

    @classmethod
    def resolve(cls, policy: Any, rules: Rules) -> Backend:
        """The backend of `policy`'s kernel switches (kernels.*) on `rules`' mesh."""
        platform = rules.platform
        unsplit_cache = rules.shards("cache_seq") == 1  # the attention kernels take whole rows
        if platform == "cpu":
            on = policy.kernels and cpu.available()
            alone = on and rules.mesh.size == 1
            f32 = policy.dtype.name == "float32" and policy.params == "float32"
            invariant = on and policy.batch_invariant
            bf16_rows = cpu.bf16_rows() if on and policy.int4_activations == "bfloat16" else 0
            bf16_rows = min(bf16_rows, 1) if invariant else bf16_rows
            return cls(platform, product_kernel=alone, quant_kernels=on, int4_bf16_rows=bf16_rows,
                       any_rows=invariant,
                       attention_kernel=on and unsplit_cache,
                       panels=alone and policy.panel_weights and f32 and policy.quantize == "none",
                       int8_screen=alone and policy.greedy_screen and policy.dtype.name == "float32",
                       huge_pages=policy.huge_pages, step_tokens=16)
        if platform == "tpu":
            return cls(platform, ragged_experts=policy.pallas_moe, row_major_tables=True,
                       experts_vmem=_tpu().EXPERTS_VMEM_BYTES.get(rules.device_kind, 0)
                       if policy.kernels and not policy.pallas_moe and policy.quantize == "none" else 0,
                       pallas_paged="tpu" if policy.kernels and unsplit_cache else "")
        gpu_paged = policy.kernels and policy.pallas_attention and unsplit_cache
        return cls(platform, pallas_paged="gpu" if gpu_paged else "")

    @property
    def compiler_options(self) -> dict[str, Any] | None:
        """XLA options for the engine's programs. On CPU, region analysis in copy insertion: a layer's
        cache is read (attention) and then written in place, and without it XLA:CPU copies the
        whole cache on every step. Batch invariant, no YNNPACK fusions: XLA:CPU hands some
        reductions to YNNPACK by their shape (a softmax's sum over the vocabulary of one row, not
        of three), which sums in another order."""
        if self.platform != "cpu":
            return None
        return {"xla_cpu_copy_insertion_use_region_analysis": True,
                **({"xla_cpu_experimental_ynn_fusion_type": ""} if self.any_rows else {})}

    # --- the kernel of each operation, or None for XLA's ------------------------------------------

    def matmul_f32(self, rows: int, x: jax.Array, w: jax.Array) -> Callable | None:
        """A projection's product, x [rows, C] by w (models/kernels/cpu.matmul_f32): float32, up
        to PRODUCT_KERNEL_ROWS rows (any, batch invariant), on one CPU device."""
        if self.product_kernel and (rows <= PRODUCT_KERNEL_ROWS or self.any_rows) \
                and x.dtype == w.dtype == jnp.float32:
            return cpu.matmul_f32
        return None

    def rms_norm(self, rows: int, x: jax.Array, w: jax.Array) -> Callable | None:
        """rms_norm in one call (models/kernels/cpu.rms_norm), where XLA:CPU runs four small
        operations with gaps between them: for the rows matmul_f32 takes."""
        if self.matmul_f32(rows, x, w) is None:
            return None
        return cpu.rms_norm

    def greedy_screen(self, w: jax.Array, rows: int) -> Callable | None:
        """What builds an unembedding w's int8 screen (models/kernels/cpu.greedy_screen), through
        which greedy tokens come without every logit: a float32 w, up to PRODUCT_KERNEL_ROWS rows,
        one CPU device. Its tokens come from `screened_greedy`."""
        if self.int8_screen and isinstance(w, jax.Array | jax.ShapeDtypeStruct) and w.dtype == jnp.float32 \
                and rows <= PRODUCT_KERNEL_ROWS:
            return cpu.greedy_screen
        return None

    def screened_greedy(self) -> Callable:
        """The greedy tokens of hidden states through a screen greedy_screen built."""
        return cpu.greedy_screened

    def int_matmul(self, int4: bool) -> Callable | None:
        """The product of activations by int8 (or int4) weights stored output dimensions first
        (models/kernels/cpu.matmul_nk_s8, matmul_nk_s4)."""
        if not self.quant_kernels:
            return None
        return functools.partial(cpu.matmul_nk_s4, bf16_rows=self.int4_bf16_rows) if int4 \
            else cpu.matmul_nk_s8

    def paged_attention(self, q: jax.Array, pool: jax.Array, scale: jax.Array | None
                        ) -> Callable | None:
        """A ragged step's queries [T, N, H] over a pool of pages through page tables, as
        models/kernels/cpu.paged_attention takes them: on CPU float32 queries over a float32 or
        int8 pool; on TPU (folded pools) any pool but an int8 one; on NVIDIA GPUs any pool."""
        if self.attention_kernel and q.dtype == jnp.float32 and pool.dtype in (jnp.float32, jnp.int8):
            return cpu.paged_attention
        if self.pallas_paged == "tpu" and scale is None:
            return _tpu().ragged_paged_attention
        if self.pallas_paged == "gpu":
            from models.kernels import gpu
            return gpu.paged_attention
        return None

    def write_pages(self, pool_dtype: Any) -> Callable | None:
        """A step's new keys written into their pages in place (TPU, folded pools, not int8)."""
        if self.pallas_paged == "tpu" and jnp.dtype(pool_dtype) != jnp.int8:
            return _tpu().write_pages
        return None

    def page_fold(self, pool_dtype: Any, head_dim: int) -> int:
        """Slots a row of a pool holds side by side: folded for the TPU kernels (1 elsewhere)."""
        if self.write_pages(pool_dtype) is None:
            return 1
        return _tpu().fold(head_dim)

    @property
    def experts_kernel(self) -> bool:
        return self.experts_vmem > 0

    def experts(self, tokens: int, hidden: int, ffn: int, dtype: Any) -> Callable | None:
        """GPT-OSS's experts on a step's few tokens, each expert's weights read once and only the
        tokens' outputs written (TPU v5e and v6e, kernels.enabled): models/kernels/tpu.experts,
        where the step's tokens fit its VMEM; `ffn` is a shard's F."""
        if not self.experts_kernel:
            return None
        tpu = _tpu()
        need = tpu.experts_vmem_bytes(tokens, tokens, hidden, ffn, jnp.dtype(dtype).itemsize)
        return tpu.experts if need <= self.experts_vmem else None

    def grouped_matmul(self) -> Callable | None:
        """GPT-OSS's experts over many tokens as ragged groups of a Pallas grouped matmul
        (JAX's megablox gmm; TPU, kernels.pallas_moe)."""
        if not self.ragged_experts:
            return None
        from jax.experimental.pallas.ops.tpu.megablox import gmm
        return gmm


def _tpu() -> ModuleType:
    """The TPU kernels, imported where a TPU mesh asks for one: their Pallas backend (Mosaic) is
    loaded for nothing else."""
    from models.kernels import tpu
    return tpu
