"""The kernels against numpy: the CPU kernels (the float32 product of a decode step's few rows,
the quantised products, the greedy screen, attention over pages with sinks, windows and padding
queries), and the TPU and GPU ones in Pallas' interpreter. (Whole models through them:
test_models, test_gptoss.)"""

import functools
import os
import platform
import subprocess
import sys

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels import cpu, gpu, tpu


@pytest.mark.parametrize("w_nk", [False, True], ids=["w_KN", "w_NK"])
@pytest.mark.parametrize("M,K,N", [(1, 576, 6144), (2, 100, 37), (3, 7, 300), (9, 130, 64),
                                   (1, 1536, 17), (1, 576, 592), (8, 512, 1100), (5, 40, 2000),
                                   (6, 33, 96), (7, 576, 192), (4, 24, 530)])
def test_f32_product_matches_numpy(M, K, N, w_nk):
    """Both weight layouts; rows in groups of 8, 4, 2, 1, and 3, 5, 6 or 7 rows padded with zero
    rows to 4 or 8; K not a multiple of the row sweep (16) or of a vector (8 or 16 lanes); N in
    register blocks, then blocks of 4 vectors and 1, single columns past those, and fewer columns
    than threads."""
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32)
    got = jax.jit(functools.partial(cpu.matmul_f32, w_nk=w_nk))(x, np.ascontiguousarray(w.T) if w_nk else w)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, rtol=1e-5, atol=2e-5 * np.sqrt(K))


@pytest.mark.parametrize("M,K,N", [(1, 576, 576), (1, 576, 192), (1, 1536, 17), (2, 100, 37),
                                   (3, 7, 300), (8, 512, 1100), (5, 40, 2000), (7, 576, 192),
                                   (9, 130, 64), (13, 600, 70), (128, 576, 1536), (50, 1, 130)])
def test_panel_product_matches_numpy(M, K, N):
    """W in panels of 64 columns (numpy's own packing, checked against pack_panels in both
    layouts), the last one padded: up to 8 rows in one block over runs of k that the team
    claims, more in blocks of 6 rows over runs of 256 k (K past one run, rows past one group of
    48 and short of a block), fewer panels than threads."""
    rng = np.random.default_rng(M * K + N)
    x = rng.standard_normal((M, K), dtype=np.float32)
    w = rng.standard_normal((K, N), dtype=np.float32)
    P = -(-N // 64)
    want = np.zeros((P, K, 64), np.float32)
    for p in range(P):
        cols = w[:, p * 64:(p + 1) * 64]
        want[p, :, :cols.shape[1]] = cols
    np.testing.assert_array_equal(np.asarray(cpu.pack_panels(jnp.asarray(w))), want)
    np.testing.assert_array_equal(np.asarray(cpu.pack_panels(jnp.asarray(w.T), w_nk=True)), want)
    got = jax.jit(cpu.matmul_panels, static_argnums=2)(x, want, N)
    np.testing.assert_allclose(np.asarray(got), x.astype(np.float64) @ w, rtol=1e-5, atol=2e-5 * np.sqrt(K))


@pytest.mark.parametrize("shape,eps", [((1, 1, 576), 1e-5), ((3, 1, 100), 1e-6), ((8, 64), 1e-5),
                                       ((2, 7), 0.5), ((1, 1, 2880), 1e-5)])
def test_rms_norm_matches_numpy(shape, eps):
    """A decode step's norm in one kernel call: x / sqrt(mean(x^2) + eps) * w in float64 numpy, for
    rows of 576 (SmolLM2), 2880 (GPT-OSS), widths off the vector length, and an eps that
    matters; a zero row gives zeros."""
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    x.reshape(-1, shape[-1])[0] = 0.0
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w
    got = jax.jit(cpu.rms_norm, static_argnums=2)(x, w, eps)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6)


def test_f32_product_called_from_eight_devices_at_once():
    """Eight simulated devices call the kernel (both weight forms) at the same time: one call has
    the thread team, the others run on their own threads; every shard's product is still right."""
    P = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 256), dtype=np.float32)
    w = rng.standard_normal((8 * 256, 4096), dtype=np.float32)
    f = jax.jit(jax.shard_map(lambda x, w: cpu.matmul_f32(x, w), mesh=mesh, in_specs=(P("d"), P("d")),
                              out_specs=P("d"), check_vma=False))
    want = np.stack([x[d].astype(np.float64) @ w[d * 256:(d + 1) * 256] for d in range(8)])
    panels = np.concatenate([np.asarray(cpu.pack_panels(jnp.asarray(w[d * 256:(d + 1) * 256])))
                             for d in range(8)])  # [8 * 64, 256, 64]: device d's panels
    g = jax.jit(jax.shard_map(lambda x, p: cpu.matmul_panels(x, p, 4096), mesh=mesh,
                              in_specs=(P("d"), P("d")), out_specs=P("d"), check_vma=False))
    for _ in range(5):
        np.testing.assert_allclose(np.asarray(f(x, w)), want, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(np.asarray(g(x, panels)), want, rtol=1e-5, atol=1e-3)


def _screened(x, w, w_nk):
    """greedy_screened(x, w) and the screen's own argmax (its int8 rows alone)."""
    screen = cpu.greedy_screen(jnp.asarray(w), w_nk=w_nk)
    got = jax.jit(functools.partial(cpu.greedy_screened, w_nk=w_nk))(x, w, screen)
    approx = x @ (np.asarray(screen.q, np.float32) * np.asarray(screen.scale)[:, None]).T
    return np.asarray(got), approx.argmax(-1)


def _exact_argmax(x, w, w_nk):
    return (x.astype(np.float64) @ (w.T if w_nk else w).astype(np.float64)).argmax(-1)  # ties: lowest


@pytest.mark.parametrize("w_nk", [False, True], ids=["w_DV", "w_VD"])
@pytest.mark.parametrize("M,D,V", [(1, 512, 32000), (2, 64, 5000), (3, 37, 999), (8, 128, 4096),
                                   (1, 16, 1)])
def test_greedy_screen_gives_the_argmax_of_the_logits(M, D, V, w_nk):
    """Random unembeddings in both layouts, 1-8 rows, D and V not multiples of a vector."""
    rng = np.random.default_rng(M * D + V)
    w = (0.1 * rng.standard_normal((V, D) if w_nk else (D, V))).astype(np.float32)
    x = rng.standard_normal((M, D)).astype(np.float32)
    got, _ = _screened(x, w, w_nk)
    np.testing.assert_array_equal(got, _exact_argmax(x, w, w_nk))


@pytest.mark.parametrize("w_nk", [False, True], ids=["w_DV", "w_VD"])
def test_greedy_screen_separates_logits_closer_than_its_int8_rows(w_nk):
    """Rows whose logits differ by far less than int8 can tell apart: a copy of the top row that
    is larger by a hair in one weight, and exact copies (ties go to the lowest index). The screen's
    own argmax gets them wrong; the kernel's is numpy's float64 one."""
    rng = np.random.default_rng(11)
    D, V, M = 96, 3000, 4
    rows = 0.1 * rng.standard_normal((V, D))
    x = rng.standard_normal((M, D)).astype(np.float32)
    want = []
    for m, (top, hair, copy) in enumerate([(100, 2500, 7), (2999, 5, 1500), (42, 43, 41), (10, 20, 6)]):
        rows[top] = 0.5 * x[m] / np.linalg.norm(x[m])  # the largest logit of row m by far
        k = int(np.argsort(np.abs(x[m]))[D // 2])  # not the row's largest: int8 keeps its scale
        rows[hair] = rows[top]
        rows[hair, k] += 1e-5 * np.sign(x[m, k])  # larger by 1e-5 |x_k|, under int8's step
        rows[copy] = rows[hair] if m >= 2 else rows[top]  # an exact tie, lower index for m >= 2
        want.append(min(hair, copy) if m >= 2 else hair)
    rows = rows.astype(np.float32)
    w = np.ascontiguousarray(rows if w_nk else rows.T)
    got, approx = _screened(x, w, w_nk)
    exact = _exact_argmax(x, w, w_nk)
    np.testing.assert_array_equal(exact, want)  # the construction holds in float64
    np.testing.assert_array_equal(got, want)
    assert (approx != exact).any()  # int8 alone could not have told


def test_greedy_screen_for_flat_and_non_finite_rows():
    """A zero row of x (every logit 0: the first index), one whose logits are all near the top
    (every row a candidate: all computed), and rows with NaN or infinity (the float32 logits'
    first maximum as the engine's greedy_tokens, V - 1 for NaN)."""
    rng = np.random.default_rng(5)
    D, V = 64, 2000
    w = (0.1 * rng.standard_normal((D, V))).astype(np.float32)
    w[:, 1000:] = w[:, :1] + 1e-7 * rng.standard_normal((D, 1000)).astype(np.float32)  # near-copies
    x = rng.standard_normal((4, D)).astype(np.float32)
    x[0] = 0
    x[1] = 50 * w[:, 0] / np.linalg.norm(w[:, 0])  # the 1001 near-copies all top it
    x[2, 3] = np.nan
    x[3, 5] = np.inf
    got, _ = _screened(x, w, False)
    assert got[0] == 0
    assert got[1] == _exact_argmax(x[1:2], w, False)[0]
    assert got[2] == V - 1
    from runner.engine.sampling import greedy_tokens
    assert got[3] == int(greedy_tokens(jnp.asarray(x[3:4]) @ jnp.asarray(w))[0])


def test_chained_products_match_numpy():
    """A step's products and paged attention called again and again, as decode calls them: the
    kernels learn their order and the helpers read ahead what comes next (cpu_kernels.h's Chain:
    the next product's weights, each helper its own share), one row over short rows of W sweeps
    them a row at a time, the threads claim parts of W as they go, and lines ask for those a few
    KB on; the results are numpy's, and the same bits every call whichever thread took which
    part."""
    rng = np.random.default_rng(7)
    kn = [rng.standard_normal((K, N), dtype=np.float32) for K, N in [(64, 96), (96, 520), (520, 64)]]
    K, G, H, P, S = 2, 2, 64, 4, 16  # attention: 4 query heads over 2 kv heads, 4 pages of 16
    wq = rng.standard_normal((64, K * G * H), dtype=np.float32) / 8
    wo = rng.standard_normal((K * G * H, 64), dtype=np.float32) / 16
    kc, vc = (rng.standard_normal((P, K, S, H)).astype(np.float32) for _ in range(2))
    tables, rows, q_pos = np.array([[3, 1]], np.int32), np.zeros(1, np.int32), np.array([29], np.int32)
    nk = rng.standard_normal((200, 64), dtype=np.float32)  # [N, K]
    q = rng.integers(-127, 128, size=(300, 200), dtype=np.int8)
    scale = rng.uniform(0.01, 0.02, size=300).astype(np.float32)

    def step(x):
        for w in kn:
            x = cpu.matmul_f32(x, w)
        heads = cpu.matmul_f32(x, wq).reshape(1, K * G, H)
        x = cpu.paged_attention(heads, kc, vc, tables, rows, q_pos, None, None, 0.125)
        x = cpu.matmul_f32(x.reshape(1, K * G * H), wo)
        x = cpu.matmul_f32(x, nk, w_nk=True)
        return cpu.matmul_nk_s8(x, q, scale)

    def want(x):
        x = x.astype(np.float64)
        for w in kn:
            x = x @ w
        heads = (x @ wq).reshape(1, K * G, H)
        x = np_paged_attention(heads, kc, vc, tables, rows, q_pos, None, None, 0.125)
        x = x.reshape(1, K * G * H) @ wo
        return (x @ nk.T) @ (q * scale[:, None]).T.astype(np.float64)

    x = rng.standard_normal((1, 64), dtype=np.float32)
    f = jax.jit(step)
    first = np.asarray(f(x))
    for _ in range(6):
        got = np.asarray(f(x))
        np.testing.assert_allclose(got, want(x), rtol=1e-4, atol=1e-3 * np.abs(want(x)).max())
        np.testing.assert_array_equal(got, first)


def np_attention(q, k, v, k_pos, q_pos, sinks, window, scale):
    """q [B, T, N, H] at q_pos [B, T] over k, v [B, K, S, H] at k_pos [B, S] (-1: empty), the
    softmax in float64; a query that sees nothing and has no sink gives zeros."""
    B, T, N, H = q.shape
    K = k.shape[1]
    G = N // K
    k, v = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((B, T, N, H))
    for b in range(B):
        for t in range(T):
            qp = q_pos[b, t]
            seen = (k_pos[b] >= 0) & (k_pos[b] <= qp)
            if window:
                seen &= qp - k_pos[b] < window
            for n in range(N):
                s = k[b, n // G] @ q[b, t, n].astype(np.float64) * scale
                logits = list(s[seen]) + ([sinks[n]] if sinks is not None else [])
                if not logits:
                    continue
                m = max(logits)
                w = np.exp(s[seen] - m)
                total = w.sum() + (np.exp(sinks[n] - m) if sinks is not None else 0.0)
                out[b, t, n] = (w[:, None] * v[b, n // G][seen]).sum(0) / total
    return out


def quantize_slots(x):
    """[..., S, H] -> int8 and per-slot scales [..., S] (numpy, independent of the model code)."""
    scale = (np.abs(x).max(-1) / np.float32(127)).astype(np.float32)
    return np.clip(np.round(x / scale[..., None]), -127, 127).astype(np.int8), scale


def test_without_a_compiler_the_kernels_give_way_to_xla(monkeypatch, tmp_path):
    """No C++ compiler and nothing built yet: one warning, and the model still decodes (through
    XLA) with the same logits as with the kernels."""
    from models.policy import Policy
    from tests.conftest import rules_for
    from tests.forward import Rows
    from tests.reference import tiny_hf, to_podrun

    rules = rules_for("1dev")
    model, params = to_podrun(tiny_hf("llama"), rules)
    tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % 100

    def decode():
        rows = Rows(model, params, rules, Policy(), 2, 8)
        rows.prefill(tokens)
        return rows.step(tokens[:, 0])

    with_kernels = decode()
    monkeypatch.setenv("PODRUN_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    cpu.available.cache_clear()
    cpu.register.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no-such-compiler"):
            assert not cpu.available()
        # float32 sums in other orders (the kernels' panels and lanes against XLA's loops)
        np.testing.assert_allclose(decode(), with_kernels, rtol=1e-5, atol=5e-5)
    finally:
        cpu.available.cache_clear()
        cpu.register.cache_clear()


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_ragged_experts_match_numpy_in_interpret_mode(int8):
    """GPT-OSS's experts as ragged groups of the Pallas grouped matmul (megablox gmm, interpreted on
    CPU): 300 tokens x 2 assignments over 8 local experts, a third of the assignments on another
    shard (expert id E), D and F not multiples of 128, int8 weights with per-output scales."""
    from types import SimpleNamespace

    from jax.experimental.pallas.ops.tpu.megablox import gmm

    from models import gptoss

    rng = np.random.default_rng(11 + int8)
    M, k, E, D, F = 300, 2, 8, 96, 80
    c = SimpleNamespace(swiglu_limit=7.0, swiglu_alpha=1.702)
    f32 = np.float32
    x = rng.standard_normal((M, D)).astype(f32)
    expert = rng.integers(0, E + E // 2, (M, k)).clip(max=E).astype(np.int32)  # E: elsewhere
    weight = rng.random((M, k)).astype(f32)
    wgu = (rng.standard_normal((E, 2, F, D)) * 0.1).astype(f32)
    wd = (rng.standard_normal((E, D, F)) * 0.1).astype(f32)
    bgu, bd = rng.standard_normal((E, 2, F)).astype(f32), rng.standard_normal((E, D)).astype(f32)
    scales = {}
    if int8:  # the weights are int8 values, the scales per expert and output
        sgu, sd = rng.random((E, 2, F)).astype(f32) * 0.01, rng.random((E, D)).astype(f32) * 0.01
        wgu, wd = np.round(wgu * 300).clip(-127, 127), np.round(wd * 300).clip(-127, 127)
        scales = {"w_gate_up": jnp.asarray(sgu), "w_down": jnp.asarray(sd)}
    w = {"w_gate_up": jnp.asarray(wgu, jnp.float32), "w_down": jnp.asarray(wd, jnp.float32),
         "b_gate_up": jnp.asarray(bgu), "b_down": jnp.asarray(bd)}
    got = gptoss.experts_ragged(jnp.asarray(x), jnp.asarray(expert), jnp.asarray(weight), w, scales,
                                c, functools.partial(gmm, interpret=True))

    want = np.zeros((M, D))
    for m in range(M):
        for j in range(k):
            e = expert[m, j]
            if e == E:
                continue
            gu = np.einsum("ifd,d->if", wgu[e].astype(np.float64), x[m])
            if int8:
                gu = gu * sgu[e]
            gu = gu + bgu[e]
            gate, up = np.minimum(gu[0], 7.0), np.clip(gu[1], -7.0, 7.0)
            h = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
            y = wd[e].astype(np.float64) @ h
            if int8:
                y = y * sd[e]
            want[m] += weight[m, j] * (y + bd[e])
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def _experts_reference(x, norm, expert, weight, wgu, bgu, wd, bd, E, rounded):
    """GPT-OSS's RMSNorm and experts in numpy (float64), each token through its k experts;
    `rounded` rounds where the bfloat16 model does: the normalised tokens before and after their
    weight, each product, each bias sum, the activation, and the result."""
    r = (lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)) if rounded \
        else (lambda a: a)
    x = r(norm * r(x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-5)))
    want = np.zeros(x.shape)
    for m in range(x.shape[0]):
        for j in range(expert.shape[1]):
            e = expert[m, j]
            if e == E:
                continue
            gu = r(r(np.einsum("ifd,d->if", wgu[e].astype(np.float64), x[m])) + bgu[e])
            gate, up = np.minimum(gu[0], 7.0), np.clip(gu[1], -7.0, 7.0)
            h = r(gate / (1 + np.exp(-1.702 * gate)) * (up + 1))
            want[m] += weight[m, j] * r(r(wd[e].astype(np.float64) @ h) + bd[e])
    return r(want)


@pytest.mark.parametrize("dtype,load", [("float32", "buckets"), ("float32", "overfull"),
                                        ("bfloat16", "buckets")])
def test_experts_kernel_matches_numpy_in_interpret_mode(dtype, load, monkeypatch):
    """GPT-OSS's decode experts in the TPU kernel (models/kernels/tpu.experts, interpreted on CPU)
    as the MoE block calls it, its RMSNorm included: 40 tokens x 2 assignments over 4 local
    experts, a third of the assignments on another shard (expert id E), F streamed in chunks (3
    of float32, 2 of bfloat16), D no multiple of 128. In buckets of the MoE's capacity, or, when one expert takes more
    (overfull), every expert on every token; bfloat16 rounds where the XLA path does."""
    from types import SimpleNamespace

    from models import gptoss

    monkeypatch.setattr(tpu.moe, "EXPERT_CHUNK_BYTES", 3 * 32 * 96 * 4)  # F = 96 in chunks of 32
    rng = np.random.default_rng(5)
    M, k, E, D, F = 40, 2, 4, 96, 96
    c = SimpleNamespace(swiglu_limit=7.0, swiglu_alpha=1.702, rms_norm_eps=1e-5)
    dt = jnp.dtype(dtype)
    cast = lambda a: np.asarray(jnp.asarray(a, dt), np.float64)  # noqa: E731 (the kernel's inputs)
    x = cast(rng.standard_normal((M, D)) * 3 + 1)
    norm = cast(rng.random(D) + 0.5)
    expert = rng.integers(0, E + E // 2, (M, k)).clip(max=E).astype(np.int32)  # E: elsewhere
    expert[:, 1] = np.where(expert[:, 1] == expert[:, 0], E, expert[:, 1])
    if load == "overfull":
        expert[: M // 2, 0] = 1
    weight = cast(rng.random((M, k)) * (expert < E))
    wgu, wd = cast(rng.standard_normal((E, 2, F, D)) * 0.1), cast(rng.standard_normal((E, D, F)) * 0.1)
    bgu, bd = cast(rng.standard_normal((E, 2, F))), cast(rng.standard_normal((E, D)))
    capacity = 24
    counts = np.bincount(expert.reshape(-1), minlength=E + 1)[:E]
    assert (counts.max() > capacity) == (load == "overfull")
    w = {"w_gate_up": jnp.asarray(wgu, dt), "w_down_rows": jnp.asarray(np.swapaxes(wd, 1, 2), dt),
         "b_gate_up": jnp.asarray(bgu, dt), "b_down": jnp.asarray(bd, dt)}
    got = gptoss._experts_fused(jnp.asarray(x, dt), jnp.asarray(norm, dt), jnp.asarray(expert),
                                jnp.asarray(weight, dt), w, c, capacity,
                                functools.partial(tpu.experts, interpret=True))
    want = _experts_reference(x, norm, expert, weight, wgu, bgu, wd, bd, E, rounded=dtype == "bfloat16")
    got = np.asarray(got, np.float64)
    if dtype == "float32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    else:  # the same roundings; sums in another order move a result by an ulp at most
        ulp = np.abs(want) * 2.0 ** -7 + 1e-30
        assert np.all(np.abs(got - want) <= ulp), np.max(np.abs(got - want) / ulp)


# Every vector path of the kernels besides the one this machine builds natively (which the tests
# above run in-process): those tests and the int8 product's, in a subprocess whose build has the
# wider vectors switched off. Without AVX-512, the native build is the AVX2 path.
OTHER_PATHS = {"avx2": "-mno-avx512f", "portable": "-mno-avx512f -mno-avx2 -mno-fma"}
NARROWER_PATHS = ([p for p in OTHER_PATHS if p != "avx2" or b"avx512f" in cpu._cpu_features().split()]
                  if platform.machine() == "x86_64" else [])


# The portable path (for machines without AVX2) is under -m slow: it builds the kernels from scratch
# (35 s on a 2-core machine) for a path that x86 machines do not run.
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p == "portable" else p
                                  for p in NARROWER_PATHS])
def test_every_vector_path_matches_numpy(path, tmp_path):
    env = {**os.environ, "PODRUN_KERNEL_FLAGS": OTHER_PATHS[path],
           "PODRUN_KERNEL_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    built = subprocess.run([sys.executable, "-c", "from models.kernels import cpu; print(cpu.vector_path())"],
                           check=False, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.split()[-1] == path
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_kernels.py::test_f32_product_matches_numpy",
         "tests/test_kernels.py::test_panel_product_matches_numpy",
         "tests/test_kernels.py::test_rms_norm_matches_numpy",
         "tests/test_kernels.py::test_paged_attention_matches_numpy",
         "tests/test_kernels.py::test_paged_attention_in_blocks_of_query_heads_matches_numpy",
         "tests/test_kernels.py::test_paged_attention_of_a_prompt_chunk_matches_numpy",
         "tests/test_kernels.py::test_paged_attention_over_int8_pages_matches_numpy",
         "tests/test_quant.py::test_int8_kernel_matches_numpy",
         "tests/test_quant.py::test_int4_kernel_matches_numpy"],
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and "failed" not in tests.stdout


def np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window, scale):
    """Each query's keys gathered one position at a time through its sequence's page table, the
    softmax in float64; a padding query (q_pos < 0) gives zeros."""
    T, N, H = q.shape
    K, S = k_pages.shape[1:3]
    G = N // K
    out = np.zeros((T, N, H))
    for t in range(T):
        at = int(q_pos[t])
        if at < 0:
            continue
        pos = range(max(0, at - window + 1) if window else 0, at + 1)
        pages = [int(tables[rows[t], p // S]) for p in pos]
        slots = [p % S for p in pos]
        for n in range(N):
            k = k_pages[pages, n // G, slots].astype(np.float64)  # [len(pos), H]
            v = v_pages[pages, n // G, slots].astype(np.float64)
            s = k @ q[t, n].astype(np.float64) * scale
            m = max(s.max(), sinks[n]) if sinks is not None else s.max()
            w = np.exp(s - m)
            total = w.sum() + (np.exp(sinks[n] - m) if sinks is not None else 0.0)
            out[t, n] = (w[:, None] * v).sum(0) / total
    return out


def paged_case(G: int, H: int, seed: int):
    """A pool of P = 12 pages of S = 4 slots over K = 2 kv heads, and R = 3 sequences: 18, 12 and
    6 positions written, the second sharing its first page with the first (a shared prefix). The
    pages no table names, and the slots past each sequence's last position, hold NaN, as do the
    table entries past each sequence's last page (-1 or out of range): a kernel that reads any of
    them gives NaN or fails. Queries of every sequence at position 0, at the first and the last slot
    of a page, mid-page, and two padding queries (q_pos -1, one of a sequence that does not
    exist)."""
    rng = np.random.default_rng(seed)
    P, K, S, f32 = 12, 2, 4, np.float32
    N = K * G
    k_pages, v_pages = (rng.standard_normal((P, K, S, H)).astype(f32) for _ in range(2))
    tables = np.array([[3, 7, 1, 9, 6], [3, 5, 11, 1000, -1], [0, 8, -1, -1, 12]], np.int32)
    written = [18, 12, 6]
    for pages in (k_pages, v_pages):
        pages[[2, 4, 10]] = np.nan  # in no table
        pages[6, :, 2:] = np.nan  # sequence 0's last page past position 17
        pages[8, :, 2:] = np.nan  # sequence 2's, past position 5
    rows = np.array([0, 0, 1, 2, 99, 0, 2, 1, 1, 0, 2], np.int32)
    q_pos = np.array([0, 17, 4, 5, -1, 8, 3, 11, -1, 15, 0], np.int32)
    assert all(q_pos[t] < written[rows[t]] for t in range(len(rows)) if q_pos[t] >= 0)
    q = rng.standard_normal((len(rows), N, H)).astype(f32)
    return q, k_pages, v_pages, tables, rows, q_pos


@pytest.mark.parametrize("H", [16, 36, 40, 64])
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("window,with_sinks", [(None, False), (None, True), (5, False), (5, True)])
def test_paged_attention_matches_numpy(H, G, window, with_sinks):
    """A ragged step's queries over a page pool through page tables: head_dim a multiple of the
    vectors (16, 64; 40 on AVX2) takes the grouped path, 36 (40 on AVX-512) query head by query
    head; one or three query heads per kv head; keys from position 0 or within a window of 5
    (which starts mid-page and skips the table's first entries); with and without sinks."""
    q, k_pages, v_pages, tables, rows, q_pos = paged_case(G, H, seed=H * 10 + G)
    N = q.shape[1]
    sinks = np.random.default_rng(G).standard_normal(N).astype(np.float32) if with_sinks else None
    got = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a, window, 0.3))(
        q, k_pages, v_pages, tables, rows, q_pos, sinks))
    want = np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window, 0.3)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[q_pos < 0], 0.0)  # padding queries: zeros
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G,H", [(3, 40), (4, 64), (8, 64), (7, 64), (5, 128), (3, 16), (5, 16)],
                         ids=["H40-query_by_query", "G4-H64", "G8-H64", "G7-H64", "G5-H128", "G3-H16",
                              "G5-H16"])
@pytest.mark.parametrize("K,window,with_sinks", [(2, None, False), (3, 40, True), (1, None, True)],
                         ids=["2kv", "3kv-window-sinks", "1kv-sinks"])
def test_paged_attention_in_blocks_of_query_heads_matches_numpy(G, H, K, window, with_sinks):
    """A decode step's rows as SmolLM2's (3 kv heads), with one kv head or two: head_dim a multiple
    of 16 takes the grouped path (query heads in blocks of up to 8, 4 or 2 as head_dim allows, then
    what is left; scores four rows at a time where the registers allow, which G5-H16 reaches on
    AVX2 too), H = 40 the query-by-query one with its tail loops. Rows of 150 positions over 10
    pages of 16 in no order (the softmax's vectors and their padded tail), of one, and a padding
    query (zeros)."""
    rng = np.random.default_rng(G * H + K)
    P, S, M, f32 = 32, 16, 10, np.float32
    N = K * G
    k_pages, v_pages = (rng.standard_normal((P, K, S, H)).astype(f32) for _ in range(2))
    tables = rng.permutation(P)[:3 * M].reshape(3, M).astype(np.int32)
    rows, q_pos = np.arange(3, dtype=np.int32), np.array([149, 0, -1], np.int32)
    q = rng.standard_normal((3, N, H)).astype(f32)
    sinks = rng.standard_normal(N).astype(f32) if with_sinks else None
    got = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a, window, 0.125))(
        q, k_pages, v_pages, tables, rows, q_pos, sinks))
    want = np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window, 0.125)
    np.testing.assert_array_equal(got[2], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,G,window,with_sinks", [(64, 3, 5, True), (36, 1, None, False)])
def test_paged_attention_of_a_prompt_chunk_matches_numpy(H, G, window, with_sinks):
    """A step of 77 queries (a prompt's chunk beside the decode tokens), which the kernel runs on
    XLA's thread pool rather than on the team that takes a decode step's few queries."""
    q, k_pages, v_pages, tables, rows, q_pos = paged_case(G, H, seed=H + G)
    q = np.concatenate([q, *(np.roll(q, i, axis=1) for i in range(1, 7))])
    rows, q_pos = np.tile(rows, 7), np.tile(q_pos, 7)
    assert len(q_pos) > 64
    sinks = np.random.default_rng(G).standard_normal(q.shape[1]).astype(np.float32) if with_sinks else None
    got = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a, window, 0.3))(
        q, k_pages, v_pages, tables, rows, q_pos, sinks))
    want = np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window, 0.3)
    np.testing.assert_array_equal(got[q_pos < 0], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("H,window,with_sinks", [(64, None, True), (36, 5, False)],
                         ids=["H64-sinks", "H36-window"])
def test_paged_attention_over_int8_pages_matches_numpy(H, window, with_sinks):
    """int8 pages with per-slot scales [P, K, S] read exactly as their dequantised values, on the
    grouped path and the query-by-query one; the slots that paged_case fills with NaN have NaN
    scales instead."""
    q, k_pages, v_pages, tables, rows, q_pos = paged_case(3, H, seed=H)
    (kq, ks), (vq, vs) = (quantize_slots(np.where(np.isnan(x), 1.0, x)) for x in (k_pages, v_pages))
    for s, x in ((ks, k_pages), (vs, v_pages)):
        s[np.isnan(x).any(-1)] = np.nan
    N = q.shape[1]
    sinks = np.random.default_rng(1).standard_normal(N).astype(np.float32) if with_sinks else None
    got = np.asarray(jax.jit(lambda *a: cpu.paged_attention(*a[:7], window, 0.125, *a[7:]))(
        q, kq, vq, tables, rows, q_pos, sinks, ks, vs))
    want = np_paged_attention(q, kq * ks[..., None], vq * vs[..., None], tables, rows, q_pos, sinks,
                              window, 0.125)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[q_pos < 0], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("row,at,match", [
    (2, 9, "tables\\[2, 2\\] = -1"), (1, 14, "tables\\[1, 3\\] = 1000"), (3, 0, "outside tables"),
    (0, 20, "past its table")],
    ids=["garbage-entry", "entry-past-the-pool", "no-such-row", "past-the-table"])
def test_paged_attention_refuses_table_entries_it_would_read_out_of_range(row, at, match):
    """A query whose visible positions need a table entry that names no page, a sequence outside
    the tables, or a position past its table is an invalid argument, not a read out of bounds."""
    q, k_pages, v_pages, tables, rows, q_pos = paged_case(1, 16, seed=0)
    rows[1], q_pos[1] = row, at
    with pytest.raises(Exception, match="podrun_paged_attention: query 1 .*" + match):
        np.asarray(cpu.paged_attention(q, k_pages, v_pages, tables, rows, q_pos, None, None, 0.3))


# --- the paged engine's TPU kernels, in Pallas' interpreter ---------------------------------------


def folded(pool: np.ndarray, f: int) -> np.ndarray:
    """A pool [P, K, S, H] as the TPU kernels store it: f slots side by side in a row."""
    P, K, S, H = pool.shape
    return pool.reshape(P, K, S // f, f * H)


@pytest.mark.parametrize("H,T,window,with_sinks", [
    (64, 1, 100, True),  # decode rows: two slots a row of 128 lanes
    (32, 128, None, False),  # a chunk in two blocks of queries, four slots a row
    pytest.param(128, 1, None, False, marks=pytest.mark.slow),
    pytest.param(64, 48, 40, True, marks=pytest.mark.slow)],
    ids=["decode-H64-window-sinks", "chunk-H32", "decode-H128", "chunk-H64-window-sinks"])
def test_pallas_paged_attention_matches_numpy_in_interpret_mode(H, T, window, with_sinks):
    """models/kernels/tpu.paged_attention, run by Pallas' interpreter on CPU, against numpy over
    each sequence's pages gathered in order: sequences over several blocks of pages (16 pages of
    16 slots a block), pages shared by two tables, a padding query (zeros), windows, sinks."""
    rng = np.random.default_rng(H + T)
    P, K, S, G, M = 96, 2, 16, 8, 40
    N, f32 = K * G, np.float32
    Q = 4 if T == 1 else 1
    kp, vp = (rng.standard_normal((P, K, S, H)).astype(f32) for _ in range(2))
    tables = np.stack([rng.permutation(P)[:M] for _ in range(Q)]).astype(np.int32)
    if T == 1:
        tables[1, :5] = tables[0, :5]  # a shared prefix
        q_pos = np.array([[M * S - 1], [300], [-1], [7]], np.int32)
    else:
        q_pos = (500 + np.arange(T, dtype=np.int32))[None]
        q_pos[0, -3:] = -1  # a chunk padded at its end
    q = rng.standard_normal((Q, T, N, H)).astype(f32)
    sinks = rng.standard_normal(N).astype(f32) if with_sinks else None
    f = tpu.fold(H)
    got = tpu.paged_attention(q, folded(kp, f), folded(vp, f), tables, q_pos, sinks, window, 0.125,
                              interpret=True)
    # each sequence's keys in order: position p in page table[p // S], slot p % S
    kc, vc = (np.moveaxis(x[tables], 2, 1).reshape(Q, K, M * S, H) for x in (kp, vp))
    k_pos = np.tile(np.arange(M * S, dtype=np.int32), (Q, 1))
    want = np_attention(q, kc, vc, k_pos, q_pos, sinks, window, 0.125)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    assert not np.asarray(got)[q_pos < 0].any()


def test_pallas_paged_attention_of_a_decode_row_does_not_depend_on_the_others_in_interpret_mode():
    """Batch invariance of the TPU kernel's decode rows (Pallas' interpreter): a row's output is
    the same bits alone and beside three other rows at other positions over other pages."""
    rng = np.random.default_rng(3)
    P, K, S, G, M, H = 48, 2, 16, 8, 20, 64
    kp, vp = (rng.standard_normal((P, K, S, H)).astype(np.float32) for _ in range(2))
    f = tpu.fold(H)
    tables = np.stack([rng.permutation(P)[:M] for _ in range(4)]).astype(np.int32)
    q = rng.standard_normal((4, 1, K * G, H)).astype(np.float32)
    q_pos = np.array([[300], [77], [250], [12]], np.int32)
    run = lambda n: np.asarray(tpu.paged_attention(q[:n], folded(kp, f), folded(vp, f), tables[:n],
                                                   q_pos[:n], None, None, 0.125, interpret=True))
    np.testing.assert_array_equal(run(4)[0], run(1)[0])


def test_pallas_write_pages_writes_each_slot_once_in_interpret_mode(monkeypatch):
    """models/kernels/tpu.write_pages in Pallas' interpreter: a decode step's tokens (each its
    own page), a chunk's consecutive slots over three pages and several blocks of tokens (a page read,
    changed and written back by each), padding dropped; every other slot as it was."""
    rng = np.random.default_rng(1)
    P, K, S, H = 12, 2, 16, 64
    monkeypatch.setattr(tpu.writes, "WRITE_BLOCK_BYTES", 8 * K * S * 128 * 4 // 2)  # 8 tokens a block
    pool = rng.standard_normal((P, K, S, H)).astype(np.float32)
    slots = np.concatenate([[3 * S + 5, 7 * S + 15, P * S, 0],  # decode tokens, padding
                            9 * S + 10 + np.arange(30), [P * S + 3] * 2]).astype(np.int32)
    new = rng.standard_normal((len(slots), K, H)).astype(np.float32)
    want = pool.copy()
    for t, s in enumerate(slots):
        if s < P * S:
            want[s // S, :, s % S] = new[t]
    f = tpu.fold(H)
    got = tpu.write_pages(folded(pool, f), new, slots, interpret=True)
    np.testing.assert_array_equal(np.asarray(got).reshape(P, K, S, H), want)


# --- the paged engine's GPU (Triton) kernel, in Pallas' interpreter -------------------------------


def ragged_step_case(G: int, H: int, C: int, seed: int):
    """A ragged step as the paged engine lays it out, over a pool of 128 pages of S = 4 slots and
    K = 2 kv heads: R = 5 rows, their decode tokens first (row 1 idle, row 3 prefilling), then C
    tokens of row 3's prompt, its positions 90 to 90 + C - 1 (several of them padding at the end).
    Rows hold 150, 70, 0, 90 + C and 9 positions, rows 0 and 4 sharing their first two pages.
    Pages no table names, slots past a row's last position and table entries past its last page
    (-1, 1000) hold NaN or garbage: a kernel that reads any of them gives NaN or fails."""
    rng = np.random.default_rng(seed)
    P, K, S, M, f32 = 128, 2, 4, 48, np.float32
    N = K * G
    held = [150, 70, 0, 90 + C, 9]
    order = iter(rng.permutation(P - 8))  # pages 120-127 in no table
    tables = np.full((5, M), -1, np.int32)
    for r, n in enumerate(held):
        for i in range(-(-n // S)):
            tables[r, i] = next(order)
    tables[4, :2] = tables[0, :2]  # a shared prefix
    tables[1, 20:] = 1000
    k_pages, v_pages = (rng.standard_normal((P, K, S, H)).astype(f32) for _ in range(2))
    for pages in (k_pages, v_pages):
        pages[120:] = np.nan
        for r, n in enumerate(held):
            if n % S:
                pages[tables[r, n // S], :, n % S:] = np.nan
    padding = 3 if C > 3 else 0
    q_pos = np.concatenate([[149, -1, -1, -1, 8], 90 + np.arange(C - padding), [-1] * padding])
    rows = np.concatenate([np.arange(5), np.full(C, 3)])
    q = rng.standard_normal((len(q_pos), N, H)).astype(f32)
    return q, k_pages, v_pages, tables, rows.astype(np.int32), q_pos.astype(np.int32)


@pytest.mark.parametrize("G,H,C,window,with_sinks", [
    (4, 64, 0, None, False),  # decode rows alone
    (1, 32, 40, None, True),  # a chunk of one block of rows
    (3, 64, 50, 37, True),  # G no power of two, rows of a block over several tokens, a window
    (8, 128, 20, 100, False)],  # GPT-OSS's groups
    ids=["decode-G4", "chunk-G1-sinks", "chunk-G3-window-sinks", "chunk-G8-window"])
@pytest.mark.parametrize("programs", [512, 1], ids=["split", "unsplit"])
def test_gpu_paged_attention_matches_numpy_in_interpret_mode(G, H, C, window, with_sinks, programs):
    """models/kernels/gpu.paged_attention, run by Pallas' interpreter on CPU, against numpy over
    each query's positions gathered through its table: decode rows over several steps of pages
    (split over programs, or each row's in one), idle rows and padding (zeros), a chunk's rows of
    (token, head) pairs, shared pages, windows, sinks, and garbage wherever no query looks."""
    q, k_pages, v_pages, tables, rows, q_pos = ragged_step_case(G, H, C, seed=G * 100 + C)
    sinks = np.random.default_rng(G).standard_normal(q.shape[1]).astype(np.float32) if with_sinks else None
    got = np.asarray(gpu.paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window,
                                         0.3, interpret=True, programs=programs))
    want = np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, sinks, window, 0.3)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[q_pos < 0], 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_gpu_paged_attention_over_bf16_and_int8_pages(kv):
    """bfloat16 queries over bfloat16 pages, or int8 ones with a scale per slot and head, against
    numpy over the same (dequantised) values; NaN slots keep NaN scales."""
    q, k_pages, v_pages, tables, rows, q_pos = ragged_step_case(4, 64, 24, seed=5)
    bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    q = bf(q)
    if kv == "int8":
        (kq, ks), (vq, vs) = (quantize_slots(np.where(np.isnan(x), 1.0, x)) for x in (k_pages, v_pages))
        for s, x in ((ks, k_pages), (vs, v_pages)):
            s[np.isnan(x).any(-1)] = np.nan
        pages, scales = (kq, vq), (ks, vs)
        k_pages, v_pages = kq * ks[..., None], vq * vs[..., None]
    else:
        k_pages, v_pages = bf(k_pages), bf(v_pages)
        pages, scales = (jnp.asarray(k_pages, jnp.bfloat16), jnp.asarray(v_pages, jnp.bfloat16)), ()
    got = gpu.paged_attention(jnp.asarray(q, jnp.bfloat16), *pages, tables, rows, q_pos, None, None,
                              0.125, *scales, interpret=True)
    want = np_paged_attention(q, k_pages, v_pages, tables, rows, q_pos, None, None, 0.125)
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("K,G,H,kv,window,chunk", [(8, 4, 128, "bfloat16", None, 256),
                                                   (8, 8, 64, "bfloat16", 128, 64),
                                                   (8, 4, 128, "int8", None, 0)])
def test_gpu_paged_attention_lowers_to_triton_for_cuda(K, G, H, kv, window, chunk):
    """At the H100 configs' shapes (Llama-3.1-8B's heads over a pool of pages of 16, 256 rows and
    a chunk of 256; GPT-OSS's with a window and sinks; an int8 pool), Pallas lowers the step to
    a Triton kernel call for its decode rows and one for its chunk. Compiling them to PTX needs
    the GPU (benchmarks/gpu_check.py)."""
    sd, bf, R, P, S, M = jax.ShapeDtypeStruct, jnp.bfloat16, 256, 4096, 16, 768
    T = R + chunk
    pool = sd((P, K, S, H), jnp.int8 if kv == "int8" else bf)
    args = (sd((T, K * G, H), bf), pool, pool, sd((R, M), jnp.int32), sd((T,), jnp.int32),
            sd((T,), jnp.int32), sd((K * G,), jnp.float32) if window else None)
    scales = (sd((P, K, S), jnp.float32),) * 2 if kv == "int8" else ()
    step = jax.jit(lambda *a: gpu.paged_attention(*a[:7], window, H**-0.5, *a[7:]))
    text = step.trace(*args, *scales).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == (2 if chunk else 1)
