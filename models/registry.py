"""Architecture families by name, and a typed handle on one model (family + its config)."""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from models import decoder, fused, gpt2, gptoss, llama, panels, quant, scan, weights
from models.decoder import Output, Unembedding
from models.paged import PagedCache
from models.policy import Policy
from sharding.rules import Rules

FAMILIES: dict[str, ModuleType] = {"llama": llama, "gpt2": gpt2, "gptoss": gptoss}
# transformers' model_type -> family
HF_MODEL_TYPES: dict[str, str] = {"llama": "llama", "qwen2": "llama", "gpt2": "gpt2",
                                  "gpt_oss": "gptoss"}


@dataclasses.dataclass(frozen=True)
class Model:
    family: str
    config: Any  # the family's frozen Config dataclass

    @property
    def module(self) -> ModuleType:
        return FAMILIES[self.family]

    def declare(self, fuse: bool = False) -> dict:
        """The weights as a checkpoint holds them, or (fuse) as the blocks run them: models/fused.py."""
        decl = self.module.declare(self.config)
        return fused.declare(decl) if fuse else decl

    def prepare(self, params: Any, rules: Rules, policy: Policy) -> Any:
        """Restored weights made ready to run, as the policy says: projections fused, then
        quantised or packed in panels, then stacked for a scan over layers. `params` is consumed."""
        decl, backend = self.declare(policy.fuse_projections), policy.on(rules).backend
        if policy.fuse_projections:
            params = fused.fuse(self.declare(), params, rules)
        if policy.quantize != "none":
            params = quant.quantize(decl, params, rules, policy.quantize)
        if backend.panels:
            params = panels.pack(decl, params)
        if backend.row_major_tables:
            params = weights.pin_tables_row_major(decl, params)
        if hasattr(self.module, "for_backend"):
            params = self.module.for_backend(params, rules, backend)
        if policy.scan_layers:
            params = scan.stack(params, self.scan_period)
        return params

    def abstract_params(self, rules: Rules, policy: Policy) -> Any:
        """What `prepare` gives, as ShapeDtypeStructs with their shardings (for AOT compiles)."""
        decl, backend = self.declare(policy.fuse_projections), policy.on(rules).backend
        tree = quant.abstract_tree(decl, rules, jnp.dtype(policy.params), policy.quantize)
        if backend.row_major_tables:
            tree = weights.pin_tables_row_major(decl, tree)
        if backend.panels:
            tree = panels.abstract(decl, tree, rules)
        if hasattr(self.module, "for_backend"):
            tree = self.module.for_backend(tree, rules, backend)
        return scan.abstract(tree, self.scan_period) if policy.scan_layers else tree

    @property
    def scan_period(self) -> int:
        """Layers repeat with this period (their attention windows): what a scan loops over."""
        return scan.period(self.module.cache_spec(self.config)[0])

    def paged_cache(self, groups: int, rows: int, length: int, rules: Rules, policy: Policy,
                    page_size: int = 16) -> tuple[PagedCache, jax.Array]:
        """An empty page pool (models/paged.py; policy's cache dtype, stacked where it scans) for
        `rows` sequences of up to `length` tokens in each of `groups` groups, and the tables
        [groups, rows, M] that give each sequence M pages of its own, in order (the windowed
        layers too: their window masks what they keep). Forward passes outside the engine
        (perplexity, the tests) run over it: `cache.at(tables, tables, rows)`."""
        windows, kv_heads, head_dim = self.module.cache_spec(self.config)
        M = -(-length // page_size)
        dtype = jnp.dtype(policy.kv_cache)
        cache = PagedCache.create(groups, rows * M, rows * M if any(windows) else 0, page_size,
                                  windows, kv_heads, head_dim, dtype, rules,
                                  fold=PagedCache.fold(policy.on(rules), dtype, head_dim),
                                  period=self.scan_period if policy.scan_layers else 0)
        tables = jnp.broadcast_to(jnp.arange(rows * M, dtype=jnp.int32).reshape(rows, M),
                                  (groups, rows, M))
        return cache, tables

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return len(self.module.cache_spec(self.config)[0])

    def forward(self, params, tokens, positions, cache, rules, policy,
                output: Output = Output.LOGITS):
        """The decoder (models/decoder.forward) of this family, with `policy`'s backend resolved on
        `rules`' mesh: every caller (the engine, perplexity, the tests) runs the kernels serving
        runs."""
        return decoder.forward(self.module, params, tokens, positions, cache, self.config, rules,
                               policy.on(rules), output)

    def unembedding(self, params) -> Unembedding:
        """The weight that turns the final hidden state into logits (Output.HIDDEN's)."""
        return self.module.unembedding(params)

    def to_json(self) -> dict:
        return {"family": self.family, "config": dataclasses.asdict(self.config)}

    @classmethod
    def from_json(cls, d: dict) -> Model:
        family = d["family"]
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}; known: {sorted(FAMILIES)}")
        fields = dict(d["config"])
        for k, v in fields.items():  # JSON turns tuples of pairs into lists of lists
            if isinstance(v, list):
                fields[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        return cls(family, FAMILIES[family].Config(**fields))

    @classmethod
    def preset(cls, family: str, name: str) -> Model:
        return cls(family, FAMILIES[family].PRESETS[name])

    @classmethod
    def named(cls, spec: str) -> Model:
        """From "family:preset", e.g. "llama:smollm2-135m"."""
        family, _, name = spec.partition(":")
        if family not in FAMILIES or name not in FAMILIES[family].PRESETS:
            known = [f"{f}:{p}" for f, m in FAMILIES.items() for p in m.PRESETS]
            raise ValueError(f"unknown model {spec!r}; known: {', '.join(known)}")
        return cls.preset(family, name)

    @classmethod
    def from_hf_config(cls, hf: dict) -> Model:
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}"
            )
        family = HF_MODEL_TYPES[model_type]
        return cls(family, FAMILIES[family].config_from_hf(hf))
