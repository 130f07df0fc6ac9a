"""A rollout loop to copy: a policy improved by optax on a verifiable reward, podrun generating.

    pip install optax && python examples/rollout.py [--steps=15]

The policy is a tiny Llama (checkpoint.model llama:tiny: 2 layers, a vocabulary of 256), its
weights made here, as a trainer's are. Each step:

1. podrun samples 8 tokens after each of 32 random prompts (Generator.generate), with the
   log-probability of each sampled token;
2. the reward is verifiable: the share of the 8 tokens that are even ids;
3. the trainer's own forward pass (below, in plain JAX) scores the same tokens, and REINFORCE with
   the batch's mean reward as baseline takes an Adam step;
4. the new weights go to podrun (Generator.update_weights): copied onto its shardings, nothing
   compiled again.

The mean reward climbs from about 0.5 towards 1. Each line also prints the largest difference
between podrun's log-probability of a sampled token and the trainer's for the same weights: what
a trainer that uses the sampler's log-probabilities (PPO's ratio) relies on being small.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402

from models.registry import Model  # noqa: E402
from runner.engine import Request  # noqa: E402
from runner.generator import Generator  # noqa: E402

flags.DEFINE_integer("steps", 15, "optimizer steps")
FLAGS = flags.FLAGS
MODEL = "llama:tiny"
PROMPT, ANSWER, ROLLOUTS = 8, 8, 32


def init(model: Model, seed: int) -> dict:
    """The policy's weights in the checkpoint's names (Model.declare), as a trainer makes them."""
    leaves, tree = jax.tree.flatten(model.declare(), is_leaf=lambda x: hasattr(x, "init"))
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = [jnp.ones(w.shape) if w.init == "ones" else jnp.zeros(w.shape) if w.init == "zeros"
            else w.scale * jax.random.normal(k, w.shape) for w, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, made)


def logits(p: dict, tokens: jax.Array, c) -> jax.Array:
    """The trainer's Llama: tokens [B, T] -> logits [B, T, V] (transformers' LlamaForCausalLM)."""
    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * w

    T = tokens.shape[1]
    inv = jnp.asarray(c.rope.inv_freq())
    angle = jnp.arange(T)[:, None] * inv[None]  # [T, H / 2]
    cos, sin = (jnp.concatenate([f(angle)] * 2, -1)[None, :, None] for f in (jnp.cos, jnp.sin))
    rotate = lambda x: x * cos + jnp.concatenate([-x[..., x.shape[-1] // 2:],
                                                  x[..., : x.shape[-1] // 2]], -1) * sin
    causal = jnp.tril(jnp.ones((T, T), bool))
    x = p["embed"][tokens]
    for layer in p["layers"]:
        h = norm(x, layer["attn_norm"])
        q = rotate(jnp.einsum("btd,dnh->btnh", h, layer["wq"]))
        k = rotate(jnp.einsum("btd,dkh->btkh", h, layer["wk"]))
        v = jnp.einsum("btd,dkh->btkh", h, layer["wv"])
        g = c.num_heads // c.num_kv_heads
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(c.head_dim)
        a = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1)
        x = x + jnp.einsum("bnts,bsnh,nhd->btd", a, v, layer["wo"])
        h = norm(x, layer["mlp_norm"])
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    x = norm(x, p["final_norm"])
    return x @ (p["embed"].T if p["unembed"] is None else p["unembed"])


def answer_logprobs(p: dict, tokens: jax.Array, c) -> jax.Array:
    """Each answer token's log-probability [B, ANSWER] given what comes before it."""
    z = jax.nn.log_softmax(logits(p, tokens, c)[:, PROMPT - 1: -1], -1)
    return jnp.take_along_axis(z, tokens[:, PROMPT:, None], -1)[..., 0]


def main(argv) -> None:
    del argv
    model = Model.named(MODEL)
    c = model.config
    params = init(model, seed=0)
    gen = Generator("configs/cpu.py", {"checkpoint.model": MODEL, "compilation_cache.dir": "",
                                       "generation.max_prompt_len": PROMPT,
                                       "generation.max_new_tokens": ANSWER,
                                       "generation.batch_size": ROLLOUTS}, params=params)
    optimizer = optax.adam(1e-2)
    state = optimizer.init(params)

    @jax.jit
    def train_step(params, state, tokens, advantage):
        def loss(p):
            return -jnp.mean(advantage[:, None] * answer_logprobs(p, tokens, c))
        grads = jax.grad(loss)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.RandomState(0)
    began = time.perf_counter()
    for step in range(FLAGS.steps):
        prompts = rng.randint(0, c.vocab_size, (ROLLOUTS, PROMPT))
        done = gen.generate([Request(tuple(int(t) for t in p), ANSWER, temperature=1.0,
                                     seed=step * ROLLOUTS + i, logprobs=True)
                             for i, p in enumerate(prompts)])
        answers = np.array([d.token_ids for d in done])
        reward = np.mean(answers % 2 == 0, axis=1)
        tokens = jnp.asarray(np.concatenate([prompts, answers], axis=1))
        sampler = np.array([[float(x.logprob) for x in d.logprobs] for d in done])
        gap = np.max(np.abs(sampler - np.asarray(answer_logprobs(params, tokens, c))))
        params, state = train_step(params, state, tokens, jnp.asarray(reward - reward.mean()))
        gen.update_weights(params)
        print(f"step {step:2d}  reward {reward.mean():.3f}  |podrun - trainer| logprob "
              f"{gap:.1e}  {time.perf_counter() - began:5.1f} s", flush=True)


if __name__ == "__main__":
    app.run(main)
