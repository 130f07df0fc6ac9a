"""Logical axis names -> mesh axes, and the one helper that applies them.

Weights, activations and the KV cache name their dimensions with logical axes; a deployment maps
those names to mesh axes once, in its config. Weight axes: vocab, embed, heads, kv_heads, head_dim,
mlp, experts. Activation axes: batch, seq, act_embed, act_heads, act_kv_heads, act_mlp, act_vocab,
act_experts. Cache axes: cache_batch, cache_seq, cache_kv_heads. Separate names let a deployment
shard a weight's `embed` (FSDP-style) without also sharding every activation's embed dimension.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.mesh import MESH_AXES

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    # weights
    "vocab": ("model",),
    "embed": (),
    "heads": ("model",),
    "kv_heads": ("model",),
    "head_dim": (),
    "mlp": ("model",),
    "experts": ("expert",),
    # activations
    "batch": ("data",),
    "seq": ("sequence",),
    "act_embed": (),
    "act_heads": ("model",),
    "act_kv_heads": ("model",),
    "act_mlp": ("model",),
    "act_vocab": ("model",),
    "act_experts": ("expert",),
    # KV cache
    "cache_batch": ("data",),
    "cache_seq": ("sequence",),
    "cache_kv_heads": ("model",),
}


class RulesError(ValueError):
    """A sharding rule is malformed or cannot apply to a tensor."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """A mesh plus the mapping from logical axis names to its axes; hashable (a static jit arg)."""

    mesh: Mesh
    table: tuple[tuple[str, tuple[str, ...]], ...]
    # The platform the programs are for, where it is not the mesh's devices' ("": theirs): a GPU
    # deployment's programs lowered on CPU devices for their cost analysis (runner.tools.plan).
    target: str = ""

    @classmethod
    def make(cls, mesh: Mesh, table: Mapping[str, Sequence[str]] | None = None) -> Rules:
        merged = dict(DEFAULT_RULES)
        for name, axes in (table or {}).items():
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            axes = tuple(a for a in axes if a)
            unknown = [a for a in axes if a not in MESH_AXES]
            if unknown:
                raise RulesError(
                    f"sharding rule {name!r} -> {axes}: unknown mesh axis {unknown[0]!r}; "
                    f"mesh axes are {MESH_AXES}"
                )
            if len(set(axes)) != len(axes):
                raise RulesError(f"sharding rule {name!r} -> {axes} names a mesh axis twice")
            merged[name] = axes
        return cls(mesh, tuple(sorted(merged.items())))

    def axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for name, axes in self.table:
            if name == logical:
                return axes
        raise RulesError(f"no sharding rule for logical axis {logical!r}; add it to the config's rules")

    def spec(self, *logical: str | None, shape: Sequence[int] | None = None) -> PartitionSpec:
        """The PartitionSpec of a tensor whose dimensions have these logical names.

        With `shape`, mesh axes that do not divide their dimension are dropped (that dimension is
        replicated instead): activations such as a one-token decode step stay legal on any mesh.
        """
        used: dict[str, str] = {}
        parts = []
        for i, name in enumerate(logical):
            axes = tuple(a for a in self.axes(name) if self.mesh.shape[a] > 1)
            if shape is not None and shape[i] % math.prod(self.mesh.shape[a] for a in axes):
                axes = ()
            for a in axes:
                if a in used:
                    raise RulesError(
                        f"logical axes {used[a]!r} and {name!r} of one tensor both map to mesh "
                        f"axis {a!r}; a mesh axis can shard only one dimension"
                    )
                used[a] = name
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*parts)

    def sharding(self, *logical: str | None, shape: Sequence[int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*logical, shape=shape))

    @property
    def platform(self) -> str:
        """The mesh's device platform (cpu, tpu, gpu), also for an AOT topology with no devices
        attached: where the process's default backend may be another."""
        return self.target or self.mesh.devices.flat[0].platform

    @property
    def device_kind(self) -> str:
        """The mesh's devices' kind ("TPU v5 lite", ...), also for an AOT topology."""
        return self.mesh.devices.flat[0].device_kind

    def shards(self, logical: str | None) -> int:
        """How many pieces the rules cut a dimension with this logical name into."""
        return math.prod(self.mesh.shape[a] for a in self.axes(logical))


def constrain(x: jax.Array, rules: Rules, *logical: str | None) -> jax.Array:
    """with_sharding_constraint by logical names: the one way models place their activations."""
    if len(logical) != x.ndim:
        raise RulesError(f"constrain: {len(logical)} logical names {logical} for a {x.ndim}-d tensor")
    return jax.lax.with_sharding_constraint(x, rules.sharding(*logical, shape=x.shape))
