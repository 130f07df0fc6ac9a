"""Sampling on device (runner/engine/sampling.py) against numpy, jax.random's noise and
transformers' warpers: the nucleus, top_k, temperature, the Gumbel-max draw and greedy ties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

from runner.engine.sampling import CANDIDATES, greedy_tokens, nucleus, sample


def test_sampling_keeps_to_the_nucleus_and_top_k():
    """Against numpy: draws only from the smallest set of tokens whose mass reaches top_p."""
    rng = np.random.RandomState(0)
    logits = rng.randn(4, 50).astype(np.float32) * 3
    temperature = np.array([1.0, 0.5, 1.0, 0.0], np.float32)
    top_p = np.array([0.6, 0.9, 1.0, 1.0], np.float32)
    top_k = np.array([0, 0, 5, 0], np.int32)
    seeds = np.arange(400 * 4, dtype=np.uint32).reshape(400, 4)
    draws = jax.jit(jax.vmap(lambda s: sample(logits, s, np.zeros(4, np.int32), temperature, top_k, top_p)))(seeds)
    draws = np.asarray(draws)
    for b in range(3):
        z = logits[b] / temperature[b]
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        if top_k[b]:
            allowed = set(order[: top_k[b]])
        else:
            n = int(np.searchsorted(np.cumsum(p[order]), top_p[b]) + 1)
            allowed = set(order[:n])
        assert set(draws[:, b]) <= allowed
        assert len(set(draws[:, b])) > 1
    assert set(draws[:, 3]) == {int(np.argmax(logits[3]))}


def test_sampling_draws_the_nucleus_distribution_whichever_way_a_row_goes():
    """A 3000-token vocabulary: rows whose nucleus lies among the top candidates and a flat row
    whose nucleus does not (sampled over the whole vocabulary). Over 2000 seeds each peaked row's
    draws follow numpy's nucleus probabilities (top_p, top_k, temperature), and every row draws
    the same tokens beside the flat row as alone: a row's way depends on its own logits."""
    rng = np.random.default_rng(1)
    V, n = 3000, 2000
    logits = (rng.standard_normal((4, V)) * np.array([[8.0], [6.0], [7.0], [0.1]])).astype(np.float32)
    temperature = np.array([1.0, 0.7, 1.3, 1.0], np.float32)
    top_p = np.array([0.9, 0.95, 1.0, 0.9], np.float32)
    top_k = np.array([0, 0, 20, 0], np.int32)
    flat = np.sort(logits[3].astype(np.float64))[::-1]
    p = np.exp(flat - flat.max())
    assert np.searchsorted(np.cumsum(p / p.sum()), top_p[3]) > CANDIDATES  # ~2700 tokens
    draw = jax.jit(jax.vmap(lambda s, x, t, k, p: sample(x, s, np.zeros(len(x), np.int32), t, k, p),
                            in_axes=(0, None, None, None, None)))
    seeds = np.arange(n, dtype=np.uint32)[:, None] + np.zeros((1, 4), np.uint32)
    together = np.asarray(draw(seeds, logits, temperature, top_k, top_p))
    alone = np.asarray(draw(seeds[:, :3], logits[:3], temperature[:3], top_k[:3], top_p[:3]))
    np.testing.assert_array_equal(together[:, :3], alone)
    for b in range(3):
        z = logits[b].astype(np.float64) / temperature[b]
        if top_k[b]:
            z = np.where(z >= np.sort(z)[::-1][top_k[b] - 1], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p)
        kept = order[: int(np.searchsorted(np.cumsum(p[order]), top_p[b]) + 1)]
        assert len(kept) < CANDIDATES
        want = np.zeros(V)
        want[kept] = p[kept] / p[kept].sum()
        got = np.bincount(together[:, b], minlength=V) / n
        assert set(np.flatnonzero(got)) <= set(kept)
        assert np.abs(got - want).sum() / 2 < 0.06  # total variation; ~0.02 expected at n=2000
    assert len(set(together[:, 3])) > 1000  # the flat row really samples the whole vocabulary


def _nucleus_reference(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Which logits z [V] (float32, temperature-scaled) top_k then top_p keep, in float64 numpy:
    ties to the k-th largest and to the smallest in the nucleus kept."""
    z = z.astype(np.float64)
    if 0 < top_k < len(z):
        z = np.where(z >= np.sort(z)[::-1][top_k - 1], z, -np.inf)
    if top_p >= 1:
        return np.isfinite(z)
    p = np.exp(z - z.max())
    p /= p.sum()
    values = np.unique(z[np.isfinite(z)])[::-1]
    smallest = values[0]
    for v in values:  # grow the nucleus value by value while the mass above v is short
        if p[z > v].sum() >= top_p:
            break
        smallest = v
    return z >= smallest


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_way_a_row_draws_is_gumbel_max_over_its_nucleus(dtype):
    """Each row's token is exactly the Gumbel-max over numpy's nucleus, its noise jax.random's
    uniform of the row's key folded with its count then each token id: rows without filters
    (top_k 0 or V, top_p 1), nuclei among the candidates (peaked, top_k 20), a flat nucleus of
    ~2700 tokens, top_k past the candidates (alone and under top_p), and a greedy row; in float32
    and in bfloat16 (the logits TPU decoding samples from), and the same tokens for a row alone."""
    rng = np.random.default_rng(7)
    V, n = 3000, 24
    spread = np.array([3, 5, 8, 7, 0.1, 2, 0.5, 3], np.float32)[:, None]
    logits = jnp.asarray(rng.standard_normal((8, V)) * spread, dtype)
    temperature = np.array([1.0, 0.8, 1.0, 1.3, 1.0, 0.9, 1.0, 0.0], np.float32)
    top_k = np.array([0, V, 0, 20, 0, 500, 300, 0], np.int32)
    top_p = np.array([1.0, 1.0, 0.9, 1.0, 0.9, 0.8, 1.0, 1.0], np.float32)
    counts = np.arange(8, dtype=np.int32) * 3
    seeds = rng.integers(0, 2**32, (n, 8), dtype=np.uint32)
    draw = jax.jit(jax.vmap(lambda s, x, c, t, k, p: sample(x, s, c, t, k, p),
                            in_axes=(0, None, None, None, None, None)))
    got = np.asarray(draw(seeds, logits, counts, temperature, top_k, top_p))
    z = np.asarray(logits.astype(jnp.float32)) / np.maximum(temperature, 1e-6)[:, None]
    nuclei = [_nucleus_reference(z[b], top_k[b], top_p[b]) for b in range(7)]
    assert [int(m.sum()) for m in nuclei][:2] == [V, V] and nuclei[4].sum() > 2 * CANDIDATES
    assert 1 < nuclei[2].sum() < CANDIDATES and nuclei[3].sum() == 20
    assert CANDIDATES < nuclei[5].sum() < 500 and nuclei[6].sum() >= 300  # bfloat16: ties

    def noise(seed, count):  # [V]: each token's Gumbel noise under the row's key
        key = jax.random.fold_in(jax.random.key(seed), count)
        u = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(key, i), (), jnp.float32,
                                                  jnp.finfo(jnp.float32).tiny, 1.0))(jnp.arange(V))
        return np.asarray(-jnp.log(-jnp.log(u)))

    for i in range(n):
        for b in range(7):
            want = np.argmax(np.where(nuclei[b], z[b] + noise(seeds[i, b], counts[b]), -np.inf))
            assert got[i, b] == want, (i, b)
    assert (got[:, 7] == np.argmax(np.asarray(logits[7]))).all()
    alone = np.asarray(draw(seeds[:, 4:7], logits[4:7], counts[4:7], temperature[4:7], top_k[4:7],
                            top_p[4:7]))
    np.testing.assert_array_equal(alone, got[:, 4:7])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_and_top_p_keep_what_transformers_warpers_keep(seed):
    """The set `nucleus` keeps, against transformers' TopKLogitsWarper then TopPLogitsWarper on
    the same temperature-scaled logits (continuous values: no ties), over a 3000-token vocabulary
    with nuclei of 1 to ~2000 tokens."""
    rng = np.random.default_rng(seed)
    B, V = 8, 3000
    scaled = (rng.standard_normal((B, V)) * rng.uniform(0.3, 6, (B, 1))).astype(np.float32)
    top_k = np.array([0, 0, 0, 1, 50, 700, 2999, 0], np.int32)
    top_p = np.array([0.5, 0.9, 0.99, 0.9, 0.8, 0.95, 1.0, 1.0], np.float32)
    got = np.isfinite(np.asarray(jax.jit(nucleus)(scaled, top_k, top_p)))
    for b in range(B):
        x = torch.from_numpy(scaled[b : b + 1].copy())
        if top_k[b]:
            x = TopKLogitsWarper(int(top_k[b]))(None, x)
        if top_p[b] < 1:
            x = TopPLogitsWarper(float(top_p[b]))(None, x)
        want = torch.isfinite(x)[0].numpy()
        assert (got[b] == want).all(), (b, got[b].sum(), want.sum())
    assert got.sum(axis=1).min() == 1 and got.sum(axis=1).max() > 1000


def test_top_k_and_top_p_keep_every_tie_of_the_last_kept_logit():
    """bf16-rounded logits (many equal values): numpy over the distinct values; top_k keeps every
    logit equal to the k-th largest, top_p every logit equal to the smallest in the nucleus."""
    rng = np.random.default_rng(3)
    B, V = 6, 4000
    scaled = np.asarray(jnp.asarray(rng.standard_normal((B, V)) * 2, jnp.bfloat16).astype(jnp.float32))
    top_k = np.array([0, 10, 300, 0, 1, 40], np.int32)
    top_p = np.array([0.7, 1.0, 0.6, 0.0, 0.9, 0.999], np.float32)
    got = np.isfinite(np.asarray(jax.jit(nucleus)(scaled, top_k, top_p)))
    ties = 0
    for b in range(B):
        z = scaled[b].astype(np.float64)
        if top_k[b]:
            z = np.where(z >= np.sort(z)[::-1][top_k[b] - 1], z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        values = np.unique(z[np.isfinite(z)])[::-1]  # distinct kept values, largest first
        smallest = values[0]
        for v in values:  # grow the nucleus value by value while the mass above v is short
            if p[z > v].sum() < top_p[b] or top_p[b] >= 1:
                smallest = v
            else:
                break
        want = z >= smallest
        assert (got[b] == want).all(), (b, got[b].sum(), want.sum())
        ties += int((z == smallest).sum() > 1)
    assert ties >= 2  # rows whose last kept logit is tied: the case at stake


def test_greedy_tokens_are_argmax_with_ties_to_the_lowest_index():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 50)).astype(np.float32)  # many ties
    x[5] = -np.inf
    x[6, 10] = np.inf
    np.testing.assert_array_equal(np.asarray(greedy_tokens(jnp.asarray(x))), np.argmax(x, axis=-1))
