"""The decoder every family is: tokens embedded, layers of attention and MLP blocks, each added to
the residual stream after a norm of it, a final norm, and the unembedding.

    x = embed(tokens, positions)
    for each layer:  x = x + attention_out(attention(rope(qkv(attn_norm(x))), cache))
                     x = x + mlp(mlp_norm(x))
    out = unembed(final_norm(x))

A family module (models/llama.py, gpt2.py, gptoss.py) fills in the pieces (`Family` lists them)
and `forward` runs them; the activations are constrained to the rules' shardings here, once.

Einsum legend: B batch, T positions, D embed, N query heads, K kv heads, H head_dim, V vocab.
"""

from __future__ import annotations

import enum
from types import ModuleType
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from models import scan
from models.paged import PagedCache, paged_attention
from models.policy import Policy
from models.rope import Rope, RopeTable, apply_rope, rope_table
from sharding.rules import Rules, constrain

__all__ = ["Family", "Output", "Unembedding", "add_bias", "forward"]


class Output(enum.Enum):
    """What `forward` returns beside the cache, for every position [B, T, ...]."""

    LOGITS = "logits"  # [..., V]
    # The final norm's output [..., D], for the caller to unembed at the positions it samples at
    # (the greedy screen) or a few positions at a time (a prompt's log-probabilities)
    HIDDEN = "hidden"


class Unembedding(NamedTuple):
    """A model's unembedding: w [V, D] where vocab_first (a tied embedding, read as it is stored),
    else [D, V]. The engine applies it apart from the forward pass (Output.HIDDEN) to
    pick greedy tokens without every logit (models/kernels/cpu.greedy_screened) and to take a
    prompt's log-probabilities a few positions at a time."""

    w: Any
    vocab_first: bool

    def logits(self, x: jax.Array, rules: Rules, policy: Policy) -> jax.Array:
        """x [B, T, D] -> [B, T, V]."""
        spec = "BTD,VD->BTV" if self.vocab_first else "BTD,DV->BTV"
        return constrain(policy.einsum(spec, x, self.w), rules, "batch", "seq", "act_vocab")


class Family(Protocol):
    """What a family module defines. `p` is one layer's weights, `params` the whole tree."""

    def rope(self, c: Any) -> Rope | None: ...  # None: positions enter through `embed`

    def embed(self, params: dict, tokens: jax.Array, positions: jax.Array, c: Any,
              policy: Policy) -> jax.Array: ...  # [B, T] -> [B, T, D]

    def attn_norm(self, p: dict, x: jax.Array, c: Any, policy: Policy) -> jax.Array: ...

    def qkv(self, p: dict, x: jax.Array, c: Any, policy: Policy
            ) -> tuple[jax.Array, jax.Array, jax.Array]: ...  # q [B, T, N, H], k, v [B, T, K, H]

    def attention_options(self, p: dict, layer: int, c: Any) -> dict: ...  # window, sinks, scale

    def attention_out(self, p: dict, out: jax.Array, policy: Policy) -> jax.Array: ...

    def mlp_norm(self, p: dict, x: jax.Array, c: Any, policy: Policy) -> jax.Array: ...

    def mlp(self, p: dict, x: jax.Array, c: Any, rules: Rules, policy: Policy) -> jax.Array: ...

    def final_norm(self, params: dict, x: jax.Array, c: Any, policy: Policy) -> jax.Array: ...

    def unembedding(self, params: dict) -> Unembedding: ...


def add_bias(x: jax.Array, b: jax.Array | None) -> jax.Array:
    """x + b, or x where the weight has no bias."""
    return x if b is None else x + b


def forward(family: Family | ModuleType, params: dict, tokens: jax.Array, positions: jax.Array,
            cache: PagedCache, c: Any, rules: Rules, policy: Policy, output: Output = Output.LOGITS
            ) -> tuple[jax.Array, PagedCache]:
    """A step's tokens, positions [B, T] (B: the pools' groups; position -1 marks padding) through
    the decoder, over the page pools of `cache` (models/paged.py: `at` gives each token's sequence).

    Every layer writes the step's keys and values into their pages, then attends each query over
    its sequence's positions up to its own. Returns `output` and the cache with this step's keys
    and values written.
    """
    cache = cache.write_positions(positions)
    positions = jnp.maximum(positions, 0)
    rope = family.rope(c)
    table = rope_table(positions, rope, policy.dtype) if rope else None
    x = act(family.embed(params, tokens, positions, c, policy), rules)  # [B, T, D]

    def layer(p, x, cache, i):
        """Layer i (scanned: its place in the period, which fixes its window) on x [B, T, D]."""
        h, cache = attention_block(family, p, family.attn_norm(p, x, c, policy), table, cache, i,
                                   c, rules, policy)
        x = act(x + h, rules)
        return act(x + family.mlp(p, family.mlp_norm(p, x, c, policy), c, rules, policy), rules), cache

    x, cache = scan.run_layers(params, x, cache, layer)
    x = family.final_norm(params, x, c, policy)
    if output is Output.LOGITS:
        x = family.unembedding(params).logits(x, rules, policy)
    return x, cache


def attention_block(family: Family | ModuleType, p: dict, x: jax.Array, table: RopeTable | None,
                    cache: PagedCache, layer: int, c: Any, rules: Rules, policy: Policy
                    ) -> tuple[jax.Array, PagedCache]:
    """Self-attention of x [B, T, D] over the pages: the step's keys written first, then read
    with the rest."""
    q, k, v = family.qkv(p, x, c, policy)  # [B, T, N, H], [B, T, K, H] twice
    rotate = (lambda x: x) if table is None else (lambda x: apply_rope(x, table))
    q = constrain(rotate(q), rules, "batch", "seq", "act_heads", None)
    k = constrain(rotate(k), rules, "batch", "seq", "act_kv_heads", None)
    v = constrain(v, rules, "batch", "seq", "act_kv_heads", None)
    options = family.attention_options(p, layer, c)
    cache = cache.write(layer, k, v, rules, options.get("window"), policy)
    out = paged_attention(q, cache, layer, rules, policy, **options)
    return family.attention_out(p, out, policy), cache


def act(x: jax.Array, rules: Rules) -> jax.Array:
    """The residual stream [B, T, D], constrained to its sharding."""
    return constrain(x, rules, "batch", "seq", "act_embed")
