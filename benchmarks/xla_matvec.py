"""How fast XLA:CPU runs the matrix-vector products of a decode step alone: a jitted chain of a
model's layers x 7 matmuls plus the unembedding, with nothing else (no attention, no cache, no
sampling), f32, on whatever devices JAX sees first.

    JAX_PLATFORMS=cpu python benchmarks/xla_matvec.py [smollm2 | peer]

smollm2: SmolLM2-135M (30 layers); peer: the peer kit's random Llama (../shared/peers: hidden 512,
8 layers, 8 query / 2 kv heads, MLP 1536, vocab 32000, untied). The figure bounds a decode step
whose products XLA's dot runs. Measured here for the peer model over six runs: 3.42 to 4.62 ms per
step at batch 1 (162 MB at 35 to 47 GB/s; at most 216 to 292 tokens/s), 5.5 to 6.4 ms at batch 8.
podrun's own product kernel (models/kernels/cpu.matmul_f32), which the engine uses for one or two
rows on one CPU device, ran the same batch-1 chain in 2.4 to 3.4 ms.
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {  # D, F, Q (query width), KV (kv width), layers, vocab
    "smollm2": (576, 1536, 576, 192, 30, 49152),
    "peer": (512, 1536, 512, 128, 8, 32000),
}


def step(x, layers, unembed):
    for w in layers:
        a = x @ w["q"] + jnp.sum(x @ w["k"]) + jnp.sum(x @ w["v"])
        x = x + a @ w["o"]
        x = x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]
        x = x / jnp.max(jnp.abs(x))
    return jnp.sum(x @ unembed, axis=-1)  # a sum, not argmax: XLA:CPU takes ~0.5 ms for an argmax over the vocabulary


def main(name: str = "smollm2") -> None:
    D, F, Q, KV, L, V = MODELS[name]
    rng = np.random.default_rng(0)
    shapes = dict(q=(D, Q), k=(D, KV), v=(D, KV), o=(Q, D), g=(D, F), u=(D, F), d=(F, D))
    layers = jax.device_put([{n: rng.random(s, np.float32) for n, s in shapes.items()} for _ in range(L)])
    unembed = jax.device_put(rng.random((D, V), np.float32))
    nbytes = sum(x.nbytes for w in layers for x in w.values()) + unembed.nbytes
    f = jax.jit(step)
    for batch in (1, 8):
        x = jnp.ones((batch, D), jnp.float32)
        f(x, layers, unembed).block_until_ready()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            f(x, layers, unembed).block_until_ready()
            times.append(time.perf_counter() - t)
        best = min(times)
        print(f"batch {batch}: {best * 1e3:.2f} ms per step, {nbytes / best / 1e9:.1f} GB/s "
              f"({nbytes / 1e6:.0f} MB of weights)")


if __name__ == "__main__":
    main(*sys.argv[1:])
