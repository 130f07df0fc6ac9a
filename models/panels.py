"""Float32 projections packed in column panels for podrun's CPU product kernel
(kernels.panel_weights; one CPU device, float32 weights and activations, no quantisation).

A projection W, as a plain matrix [C, O] (its contracted dimensions C, its output ones O), is held
as panels [ceil(O / 64), C, 64]: the 64 columns p*64 .. p*64+63 of every row, one panel after
another, zero columns past O. The kernel (models/kernels/cpu.matmul_panels, cpu_matmul.cc) reads
each thread's share of the panels front to back, one stream of memory, and keeps a panel's sums
in registers across its rows, where [C, O] keeps a row's sums in memory and reads several streams
at once; the same kernel runs a prefill's products, as fast as XLA's dot or faster
(docs/cpu-kernels.md).

The vocabulary's tables (the embedding looks up rows; the unembedding has its own greedy path)
and GPT-OSS's experts (gathered per token) stay as restored.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from models import quant
from models.kernels import cpu
from models.weights import Weight, is_weight


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    panels: jax.Array  # float32 [ceil(O / 64), C, 64]
    out_shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})  # O's dimensions
    contract_ndim: int = dataclasses.field(metadata={"static": True})  # how many dims C had

    @property
    def ndim(self) -> int:
        """The rank of the weight as declared (its output and contracted dimensions)."""
        return len(self.out_shape) + self.contract_ndim


def takes_panels(w: Weight) -> bool:
    """Whether kernels.panel_weights packs w: every projection but the vocabulary's tables and
    GPT-OSS's experts."""
    return quant.quantizable(w) and "experts" not in w.axes and "vocab" not in w.axes


def _matrix(w: Weight, x: jax.Array) -> jax.Array:
    """The declared weight x as [C, O]."""
    out, contract = quant.projection_dims(w)
    x = jnp.transpose(x, contract + out)
    C = math.prod(x.shape[: len(contract)])
    return x.reshape(C, -1)


# one program a weight's shape, compiled once a process: new weights (Generator.update_weights)
# are packed by the programs that packed the first
@functools.partial(jax.jit, static_argnums=0)
def _pack(w: Weight, x: jax.Array) -> jax.Array:
    return cpu.pack_panels(_matrix(w, x).astype(jnp.float32))


def pack(decl: Any, params: Any) -> Any:
    """params with every projection that takes_panels replaced by its PanelWeight, one at a time
    (each restored array deleted once packed)."""
    leaves, treedef = jax.tree.flatten(decl, is_leaf=is_weight)
    flat = treedef.flatten_up_to(params)
    result = list(flat)
    for i, (w, x) in enumerate(zip(leaves, flat)):
        if x is None or not takes_panels(w):
            continue
        out, contract = quant.projection_dims(w)
        result[i] = PanelWeight(_pack(w, x), tuple(w.shape[j] for j in out), len(contract))
        x.delete()
    return jax.tree.unflatten(treedef, result)


def abstract(decl: Any, tree: Any, rules: Any) -> Any:
    """What `pack` makes of an abstract tree (ShapeDtypeStructs)."""
    def one(w: Weight, a: Any) -> Any:
        if not takes_panels(w):
            return a
        out, contract = quant.projection_dims(w)
        C, O = math.prod(w.shape[j] for j in contract), math.prod(w.shape[j] for j in out)
        shape = (-(-O // cpu.PANEL), C, cpu.PANEL)
        return PanelWeight(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rules.sharding(
            None, None, None)), tuple(w.shape[j] for j in out), len(contract))

    return jax.tree.map(one, decl, tree, is_leaf=is_weight)


def matmul(x: jax.Array, w: PanelWeight, n_free: int) -> jax.Array:
    """x [*free, *contract] . w -> [*free, *out], float32."""
    free = x.shape[:n_free]
    O = math.prod(w.out_shape)
    x2 = x.reshape(math.prod(free), -1).astype(jnp.float32)
    if cpu.available():
        y = cpu.matmul_panels(x2, w.panels, O)
    else:  # weights packed where the kernels built, run where they do not: XLA, from [C, O]
        P, C, width = w.panels.shape
        y = jnp.dot(x2, w.panels.transpose(1, 0, 2).reshape(C, P * width)[:, :O],
                    precision=jax.lax.Precision.HIGHEST)
    return y.reshape(*free, *w.out_shape)
