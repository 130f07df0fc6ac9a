"""The engine a deployment's settings ask for."""

from __future__ import annotations

from models.paged import PagedCache
from models.registry import Model
from runner.engine.engine import Engine
from runner.settings import Settings, SettingsError
from sharding.rules import Rules


def build_engine(s: Settings, model: Model, params, rules: Rules, allocate: bool = True) -> Engine:
    """The engine of generation.*, its pool sized by generation.kv_cache_gib. allocate=False:
    `params` are abstract (Model.abstract_params) until Engine.load."""
    g = s.generation
    head_dim = model.module.cache_spec(model.config)[2]
    fold = PagedCache.fold(s.policy.on(rules), s.policy.kv_cache, head_dim)
    if g.page_size % fold:
        raise SettingsError(f"generation.page_size={g.page_size} must be a multiple of {fold} with "
                            f"the TPU kernels, whose pools hold {fold} slots of head_dim {head_dim} "
                            "in a row of 128 lanes (or kernels.enabled=False)")
    try:
        return Engine(model, params, rules, s.policy, g.batch_size, g.max_prompt_len,
                      g.max_new_tokens, g.page_size, int(g.kv_cache_gib * 2**30),
                      g.steps_per_dispatch, g.chunk_tokens, allocate=allocate)
    except ValueError as e:  # a pool too small for one request
        raise SettingsError(f"generation.kv_cache_gib={g.kv_cache_gib}: {e}") from e
