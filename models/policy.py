"""The precision policy, and the products and norms it runs in the kernels its backend chose."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models import panels, quant
from models.backend import Backend
from models.norms import rms_norm
from sharding.rules import Rules


@dataclasses.dataclass(frozen=True)
class Policy:
    """Precision policy: what weights, activations and the KV cache are held in, matmul precision,
    quantisation and the programs' shape (fused, scanned, donated); the kernel switches of the
    config (kernels.*), which only `Backend.resolve` reads; and, once `on` a mesh, the backend
    that those switches give there, which every kernel choice asks."""

    params: str = "float32"
    activations: str = "float32"
    kv_cache: str = "float32"
    matmul: str = "highest"  # default | high | highest (jax.lax.Precision names)
    quantize: str = "none"  # none | int8 | int4 (weight-only: models/quant.py)
    # What activations are rounded to where int4 weights meet several rows of them (a batch's
    # step, a prompt's chunk: models/backend.Backend.int4_bf16_rows): "bfloat16" on a CPU with
    # AVX-512 BF16 runs those products at twice float32's multiply-adds; "float32" keeps them exact.
    int4_activations: str = "bfloat16"
    # A row's logits the same bits whatever rows share its step, in whichever program
    # (docs/batch-invariance.md): the CPU kernels take every row count. Off: the fastest kernel
    # for each row count.
    batch_invariant: bool = True
    # The kernel switches (models/backend.py says what each gives on which platform):
    kernels: bool = True  # podrun's own kernels (models/kernels) where they apply, else XLA's
    # NVIDIA GPUs: attention over the page pools in Pallas (Triton, models/kernels/gpu.py), each
    # row reading only the pages it holds; off until measured on a GPU.
    pallas_attention: bool = False
    # q/k/v as one product and gate/up as another (models/fused.py), fused after restore.
    fuse_projections: bool = False
    # One loop over stacked layers instead of unrolled ones (models/scan.py), the pools stacked too.
    scan_layers: bool = False
    # TPU: GPT-OSS's experts over many tokens as ragged groups of a Pallas grouped matmul.
    pallas_moe: bool = False
    # The engine donates the page pools to every call, which then updates them in place; without,
    # each call writes new pools and the old ones live until it returns.
    donate_cache: bool = True
    # CPU: the engine moves its weights and KV cache onto 2 MiB pages (runner/engine/hugepages.py).
    huge_pages: bool = True
    # CPU, one device: greedy tokens through an int8 screen of a float32 unembedding, which reads
    # a quarter of its bytes and gives the same tokens (models/kernels/cpu.greedy_screened).
    greedy_screen: bool = True
    # CPU, one device, float32: the projections held in column panels (models/panels.py), which
    # podrun's product kernel reads as one stream a thread, in decode steps and prefills.
    panel_weights: bool = True
    # What the switches give on the mesh computed on: set by `on` (not a config field).
    backend: Backend = Backend()

    def on(self, rules: Rules) -> Policy:
        """This policy for computations on `rules`' mesh: its backend resolved there."""
        backend = Backend.resolve(self, rules)
        return self if backend == self.backend else dataclasses.replace(self, backend=backend)

    @property
    def dtype(self) -> Any:
        return jnp.dtype(self.activations)

    @property
    def precision(self) -> jax.lax.Precision:
        return jax.lax.Precision[self.matmul.upper()]

    def einsum(self, spec: str, *operands: jax.Array) -> jax.Array:
        """jnp.einsum, except that a projection by a weight runs as one plain matrix product.

        A projection contracts the trailing letters of the activation with the leading (or
        trailing) letters of the weight: "BTNH,NHD->BTD", "BTD,VD->BTV". It runs as
        [..., C] x [C, O] (or [O, C]) with the weight merely reshaped, which XLA:CPU streams as
        is. Left to einsum, XLA may instead transpose a weight inside the decode loop, a copy of
        the whole matrix every step, to suit the layout of a small activation.
        """
        if isinstance(operands[-1], (quant.QWeight, quant.Q4Weight)):  # stored output dims first
            x, w = operands
            return quant.matmul(x, w, len(w.contract_axes), self.precision, self.backend)
        if isinstance(operands[-1], panels.PanelWeight):
            x, w = operands
            plan = _projection(spec, x.ndim, w.ndim)
            if plan is None:
                raise ValueError(f"{spec}: a weight in panels takes part in projections only")
            return panels.matmul(x, w, plan[0])
        if len(operands) == 2 and (plan := _projection(spec, operands[0].ndim, operands[1].ndim)):
            x, w = operands
            w = w.astype(x.dtype)
            n_free, n_contract, weight_first = plan
            free, contract = x.shape[:n_free], x.shape[n_free:]
            C = math.prod(contract)
            if weight_first:  # w: [*contract, *out]
                out = w.shape[n_contract:]
                w2, dims = w.reshape(C, math.prod(out)), ((x.ndim - n_contract,), (0,))
            else:  # w: [*out, *contract]
                out = w.shape[: w.ndim - n_contract]
                w2, dims = w.reshape(math.prod(out), C), ((x.ndim - n_contract,), (1,))
            rows = math.prod(free)
            if kernel := self.backend.matmul_f32(rows, x, w):
                y = kernel(x.reshape(rows, C), w2, w_nk=not weight_first)
            else:
                y = jax.lax.dot_general(x.reshape(*free, C), w2, (dims, ((), ())),
                                        precision=self.precision)
            return y.reshape(*free, *out)
        return jnp.einsum(spec, *operands, precision=self.precision)

    def rms_norm(self, x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
        """rms_norm, in the backend's kernel where it has one for these rows."""
        if kernel := self.backend.rms_norm(math.prod(x.shape[:-1]), x, weight):
            return kernel(x, weight, eps)
        return rms_norm(x, weight, eps)


@functools.cache
def _projection(spec: str, x_ndim: int, w_ndim: int) -> tuple[int, int, bool] | None:
    """(free letters of x, contracted letters, weight's contracted letters lead) when `spec` is
    x[*free, *c] . w[*c, *out] -> [*free, *out] or x[*free, *c] . w[*out, *c] -> [*free, *out];
    None for anything else (batched contractions such as attention's)."""
    inputs, result = spec.replace(" ", "").split("->")
    xs, ws = inputs.split(",")
    if len(xs) != x_ndim or len(ws) != w_ndim or len(set(xs)) != len(xs) or len(set(ws)) != len(ws):
        return None
    shared = [a for a in xs if a in ws]
    n = len(shared)
    if n == 0 or any(a in result for a in shared) or xs[len(xs) - n:] != "".join(shared):
        return None
    free, out_lead, out_trail = xs[: len(xs) - n], ws[n:], ws[: len(ws) - n]
    if ws[:n] == xs[len(xs) - n:] and result == free + out_lead:
        return len(free), n, True
    if ws[len(ws) - n:] == xs[len(xs) - n:] and result == free + out_trail:
        return len(free), n, False
    return None
