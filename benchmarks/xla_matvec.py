"""How fast XLA:CPU runs the matrix-vector products of a decode step alone: a jitted chain of
SmolLM2-135M's 30 layers x 7 matmuls plus the unembedding, with nothing else (no attention, no
cache, no sampling), f32, on whatever devices JAX sees first.

    JAX_PLATFORMS=cpu python benchmarks/xla_matvec.py

The figure bounds what any XLA-only decode step can reach on this machine (see issue 5's notes):
measured here, 14.5 ms and 37 GB/s at batch 1, 20.7 ms at batch 8, against about 88 GB/s of DRAM
read bandwidth.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, Q, KV, L, V = 576, 1536, 576, 192, 30, 49152  # SmolLM2-135M


def step(x, layers, unembed):
    for w in layers:
        a = x @ w["q"] + jnp.sum(x @ w["k"]) + jnp.sum(x @ w["v"])
        x = x + a @ w["o"]
        x = x + (jax.nn.silu(x @ w["g"]) * (x @ w["u"])) @ w["d"]
        x = x / jnp.max(jnp.abs(x))
    return jnp.argmax(x @ unembed, axis=-1)


def main() -> None:
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
    main()
