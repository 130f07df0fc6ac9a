"""Weight-only int8 and int4: the CPU kernels against numpy, and whole models against transformers
running the same weights dequantised. The reference's quantised weights are made here, in numpy,
independently of models/quant.py: int8 with one scale per output channel, max |w| / 127; int4 in
groups of 32 along the contraction, step (max - min) x float32(1 / 15) and minimum in float16
(GGUF's Q4_1)."""

import copy
import itertools

import jax
import jax.numpy as jnp

import numpy as np
import pytest
import torch

from models import quant
from models.kernels import cpu
from models.policy import Policy
from tests.conftest import rules_for
from tests.forward import Rows, prompt_logits
from tests.reference import VOCAB, hf_logits, tiny_hf, to_podrun


def np_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] -> int8 q [out, in], scale [out] (float32)."""
    scale = (np.abs(w).max(axis=1) / np.float32(127)).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def np_quantize_int4(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """rows [out, C] -> q uint8 [out, C / 2] (byte i of a group: value i low, value i + 16 high),
    d, m float16 [out, C / 32]."""
    g = rows.astype(np.float32).reshape(rows.shape[0], -1, 32)
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    d, m = ((hi - lo) * np.float32(1 / 15)).astype(np.float16), lo.astype(np.float16)
    d32, m32 = d.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
    u = np.round((g - m32) / np.where(d32 > 0, d32, np.float32(1)))
    u = np.clip(np.where(d32 > 0, u, 0), 0, 15).astype(np.uint8)
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(rows.shape[0], -1), d, m


def np_dequantize_int4(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    b = q.reshape(q.shape[0], -1, 16)
    u = np.concatenate([b & 15, b >> 4], axis=-1).astype(np.float64)
    w = u * d.astype(np.float64)[..., None] + m.astype(np.float64)[..., None]
    return w.reshape(q.shape[0], -1)


def np_bfloat16(x: np.ndarray) -> np.ndarray:
    """x (float32) rounded to the nearest bfloat16, ties to even, as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    bits = (bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def _bfloat16(t: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np_bfloat16(t.numpy()).astype(np.float32))


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 16, 40, 263])
def test_int4_kernel_matches_numpy(M):
    """x . W^T for W in numpy's int4 groups, every row count's path (the weights made in
    registers and shared by the rows; from bf16_rows rows on, where the CPU has AVX-512 BF16: x
    and the weights, made in float32, rounded to bfloat16, their products summed in float32)."""
    rng = np.random.default_rng(M)
    for N, K in [(1, 32), (7, 96), (37, 576), (192, 64), (300, 1536)]:
        x = rng.standard_normal((M, K)).astype(np.float32)
        w = rng.standard_normal((N, K)).astype(np.float32) * rng.uniform(0.1, 3, (N, 1)).astype(np.float32)
        q, d, m = np_quantize_int4(w)
        deq = np_dequantize_int4(q, d, m)
        assert 0.02 < np.abs(deq - w).max() / np.abs(w).max() < 0.1  # 4 bits, really
        exact = x.astype(np.float64) @ deq.T
        for bf16_rows in {0, min(cpu.bf16_rows(), 1), cpu.bf16_rows()}:
            want = exact
            if 0 < bf16_rows <= M:
                want = np_bfloat16(x) @ np_bfloat16(deq.astype(np.float32)).T
                assert np.abs(want - exact).max() > 1e-4 * np.abs(want).max()  # not float32's
            got = np.asarray(jax.jit(cpu.matmul_nk_s4, static_argnames="bf16_rows")(x, q, d, m, bf16_rows))
            assert got.shape == (M, N)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 40])
def test_int8_kernel_matches_numpy(M):
    rng = np.random.default_rng(M)
    for N, K in [(1, 16), (7, 100), (37, 576), (192, 17), (300, 1536)]:
        x = rng.standard_normal((M, K)).astype(np.float32)
        q, scale = np_quantize(rng.standard_normal((N, K)).astype(np.float32))
        want = x.astype(np.float64) @ (q.astype(np.float64) * scale[:, None]).T
        got = np.asarray(jax.jit(cpu.matmul_nk_s8)(x, q, scale))
        assert got.shape == (M, N)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())


def test_quantize_matches_numpy():
    """Every projection of a llama is stored as numpy's per-channel int8, output dims first;
    norms and an untied embedding stay as they were."""
    rules = rules_for("1dev")
    m = tiny_hf("llama")
    model, params = to_podrun(m, rules, prepare=False)
    got = quant.quantize(model.declare(), params, rules)
    layer, qlayer = params["layers"][1], got["layers"][1]
    for name, contract in [("wq", 1), ("wk", 1), ("wv", 1), ("wo", 2), ("w_gate", 1), ("w_down", 1)]:
        w = np.asarray(layer[name])
        rows = np.moveaxis(w.reshape(int(np.prod(w.shape[:contract])), -1), 0, 1)  # [out, in]
        q, scale = np_quantize(rows)
        assert qlayer[name].q.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(qlayer[name].q).reshape(q.shape), q)
        np.testing.assert_allclose(np.asarray(qlayer[name].scale).reshape(-1), scale, rtol=1e-6)
    assert isinstance(got["unembed"], quant.QWeight) and not isinstance(got["embed"], quant.QWeight)
    np.testing.assert_array_equal(np.asarray(got["layers"][0]["attn_norm"]),
                                  np.asarray(params["layers"][0]["attn_norm"]))


def test_quantize_int4_matches_numpy():
    """Under int4 every projection of a llama holds numpy's int4 groups bit for bit, output dims
    first and the contraction flattened (the attention output's heads x head_dim); the unembedding
    is int8, norms and an untied embedding stay as they were."""
    rules = rules_for("1dev")
    m = tiny_hf("llama")
    model, params = to_podrun(m, rules, prepare=False)
    got = quant.quantize(model.declare(), params, rules, "int4")
    layer, qlayer = params["layers"][1], got["layers"][1]
    for name, contract in [("wq", 1), ("wk", 1), ("wv", 1), ("wo", 2), ("w_gate", 1), ("w_down", 1)]:
        w = np.asarray(layer[name])
        rows = np.moveaxis(w.reshape(int(np.prod(w.shape[:contract])), -1), 0, 1)  # [out, in]
        want = np_quantize_int4(rows)
        held = qlayer[name]
        assert isinstance(held, quant.Q4Weight) and held.q.dtype == jnp.uint8
        assert held.d.dtype == held.m.dtype == jnp.float16
        for a, b in zip((held.q, held.d, held.m), want):
            np.testing.assert_array_equal(np.asarray(a).reshape(b.shape), b)
    assert isinstance(got["unembed"], quant.QWeight)  # the vocabulary's tables: int8
    assert not isinstance(got["embed"], (quant.QWeight, quant.Q4Weight))
    np.testing.assert_array_equal(np.asarray(got["layers"][0]["attn_norm"]),
                                  np.asarray(params["layers"][0]["attn_norm"]))


def test_int4_refuses_shards_that_split_its_groups():
    """The tiny llama's MLP contracts 96 values, 24 per shard over model=4: not whole groups of
    32. The error names the weight and the way out."""
    rules = rules_for("data2_model4")
    with pytest.raises(quant.QuantizeError, match=r"shape \(96, 64\).*contracts 96 over 4 shard.*int8"):
        to_podrun(tiny_hf("llama"), rules, policy=Policy(quantize="int4"))


@pytest.mark.parametrize("how", ["int4", "int8"])
def test_prefill_sized_products_match_numpy(how):
    """Without batch invariance, from quant.XLA_ROWS_* rows of x on, the CPU takes XLA's dot of
    the dequantised weight in place of the kernel (except for int4 products in bfloat16, which
    stay the kernel's); batch invariant, the kernel at every row count: both sides of the switch
    against numpy's weights."""
    from models.weights import Weight

    rules = rules_for("1dev")
    decl = {"w": Weight((576, 1536), ("embed", "mlp"), contract=1)}
    rng = np.random.default_rng(11)
    w = rng.standard_normal((576, 1536)).astype(np.float32)
    held = quant.quantize(decl, {"w": jax.device_put(w, rules.sharding("embed", "mlp"))}, rules,
                          how)["w"]
    if how == "int4":
        deq = np_dequantize_int4(*np_quantize_int4(w.T))
    else:
        q, scale = np_quantize(w.T)
        deq = q.astype(np.float64) * scale[:, None]
    switch = quant.XLA_ROWS_INT4 if how == "int4" else quant.XLA_ROWS_INT8
    for activations, invariant in itertools.product(("float32", "bfloat16"), (False, True)):
        policy = Policy(quantize=how, kernels=True, int4_activations=activations,
                        batch_invariant=invariant).on(rules)
        assert policy.backend.quant_kernels
        # int4 in bfloat16: the kernel at every row count from cpu.bf16_rows() on (from 1,
        # batch invariant), the switch too
        bf16_rows = policy.backend.int4_bf16_rows if how == "int4" else 0
        assert bf16_rows == (min(cpu.bf16_rows(), 1) if invariant else cpu.bf16_rows()) \
            if how == "int4" and activations == "bfloat16" else bf16_rows == 0
        for rows in (8, switch - 1, switch, 2 * switch + 3):
            x = rng.standard_normal((1, rows, 576)).astype(np.float32)
            got = jax.jit(lambda x, w: policy.einsum("BTD,DF->BTF", x, w))(x, held)
            want = x.astype(np.float64) @ deq.T
            if 0 < bf16_rows <= rows:
                want = np_bfloat16(x) @ np_bfloat16(deq.astype(np.float32)).T
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernel", "xla"])
def test_int4_product_sharded_over_its_contraction_matches_numpy(kernels):
    """A [F, D] projection with F over model=4 (64 values, two groups, a shard): each device's
    kernel (or XLA's dot) takes its groups and the partial sums are added over the mesh."""
    from models.weights import Weight

    rules = rules_for("data2_model4")
    decl = {"w": Weight((256, 64), ("mlp", "embed"), contract=1)}
    rng = np.random.default_rng(5)
    w = rng.standard_normal((256, 64)).astype(np.float32)
    x = rng.standard_normal((2, 3, 256)).astype(np.float32)
    placed = {"w": jax.device_put(w, rules.sharding("mlp", "embed"))}
    held = quant.quantize(decl, placed, rules, "int4")["w"]
    assert held.q.sharding.spec[1] == "model"  # q [D, F / 2]: the contraction stays sharded
    policy = Policy(quantize="int4", kernels=kernels, int4_activations="float32").on(rules)
    assert policy.backend.quant_kernels == kernels
    got = jax.jit(lambda x, w: policy.einsum("BTF,FD->BTD", x, w))(
        jax.device_put(x, rules.sharding("batch", "seq", "mlp")), held)
    want = x.astype(np.float64) @ np_dequantize_int4(*np_quantize_int4(w.T)).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def dequantized_reference(m, how: str = "int8", bfloat16: bool = False):
    """A copy of the transformers model whose projection weights are numpy's int8 (or int4),
    dequantised. GPT-OSS: its experts too, in int8 either way (gate_up_proj [E, D, 2F] and
    down_proj [E, F, D], one scale per expert and output column over the contracted middle
    dimension), not its router. bfloat16: each int4 projection's dequantised weight and input
    rounded to bfloat16, its products and sums float32 (precision.int4_activations=bfloat16)."""
    ref = copy.deepcopy(m)
    with torch.no_grad():
        for name, mod in ref.named_modules():
            for expert_weight in ("gate_up_proj", "down_proj"):
                e = getattr(mod, expert_weight, None)
                if isinstance(e, torch.nn.Parameter) and e.ndim == 3:
                    cols = np.moveaxis(e.numpy(), 1, 2)  # [E, out, in]
                    deq = [q.astype(np.float32) * scale[:, None] for q, scale in map(np_quantize, cols)]
                    e.copy_(torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.stack(deq), 2, 1))))
            w = getattr(mod, "weight", None)
            if w is None or w.ndim != 2 or "norm" in name or name.endswith(("ln_1", "ln_2", "ln_f")):
                continue
            if name.endswith("wpe") or (name.endswith("embed_tokens") and not m.config.tie_word_embeddings):
                continue  # position table / an untied embedding: gathered, not a projection
            if name.endswith("router"):
                continue  # GPT-OSS's router stays in full precision
            rows = w.numpy()
            conv1d = type(mod).__name__ == "Conv1D"  # GPT-2 stores [in, out]
            rows = rows.T if conv1d else rows  # [out, in]
            if how == "int4" and not name.endswith(("lm_head", "embed_tokens", "wte")):
                deq = np_dequantize_int4(*np_quantize_int4(rows)).astype(np.float32)
                if bfloat16:  # the weight and the projection's input rounded (a pre-hook)
                    deq = np_bfloat16(deq).astype(np.float32)
                    mod.register_forward_pre_hook(lambda _, args: (_bfloat16(args[0]), *args[1:]))
            else:
                q, scale = np_quantize(rows)
                deq = q.astype(np.float32) * scale[:, None]
            w.copy_(torch.from_numpy(deq.T.copy() if conv1d else deq))
    return ref


def decode_logits(model, params, rules, policy, seed, steps):
    """A batch of prompts of 3 to 12 tokens computed, then decoded one token at a time, over a
    page pool (tests/forward.py): (prompt lengths, token sequences, logits [steps + 1][B, V],
    the pool)."""
    rng = np.random.RandomState(seed)
    B, P = 4, 12
    lengths = rng.randint(3, P + 1, B)
    seqs = rng.randint(0, VOCAB, (B, P + steps)).astype(np.int32)
    rows = Rows(model, params, rules, policy, B, P + steps)
    prompts = [seqs[b, :n].tolist() for b, n in enumerate(lengths)]
    got = [np.stack([x[-1] for x in rows.prefill(prompts)])]
    for i in range(steps):
        got.append(rows.step([seqs[b, n + i] for b, n in enumerate(lengths)]))
    return lengths, seqs, got, rows.pool


def assert_decodes_as(ref, m, model, params, rules, policy, changed_by: float, steps: int = 5):
    """decode_logits' prefill and steps give the logits of transformers' `ref` (the weights
    dequantised), which differ from the unquantised `m`'s by more than `changed_by` somewhere, so
    that the match is not by accident."""
    lengths, seqs, got, _ = decode_logits(model, params, rules, policy, 3, steps)
    differs = False
    for b, n in enumerate(lengths):
        want = hf_logits(ref, seqs[b: b + 1, : n + steps])[0]
        unquantized = hf_logits(m, seqs[b: b + 1, : n + steps])[0]
        differs |= not np.allclose(want, unquantized, atol=changed_by)
        for i in range(steps + 1):
            np.testing.assert_allclose(got[i][b], want[n - 1 + i], atol=3e-4, rtol=1e-4)
    assert differs


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernel", "xla"])
@pytest.mark.parametrize("kind,mesh,fuse,scan", [
    ("llama", "1dev", True, False), ("qwen2", "data2_model4", False, False), ("gpt2", "1dev", False, True),
    ("llama3", "data2_model4", True, True), ("gptoss", "1dev", False, False),
    ("gptoss", "expert2_model2_data2", True, False)])
def test_int8_decode_matches_transformers_on_dequantized_weights(kind, mesh, fuse, scan, kernels):
    """Prefill a left-padded batch, then decode through the cache: each step's logits equal
    transformers' on the same int8 weights. The CPU kernel and XLA's dot both pass, on one device
    and sharded over data x model (the kernel then runs per shard and psums the contraction),
    with q/k/v and gate/up fused before quantisation (one scale per row of the fused product is
    the same as per row of each) or left separate, and stacked for a scan over layers (scan)."""
    rules = rules_for(mesh)
    m = tiny_hf(kind)
    ref = dequantized_reference(m)
    policy = Policy(quantize="int8", kernels=kernels, fuse_projections=fuse, scan_layers=scan)
    model, params = to_podrun(m, rules, policy=policy)
    layer = params["layer_stack"][0] if scan else params["layers"][0]
    assert ("wqkv" in layer) == (fuse or kind == "gpt2")
    assert isinstance(layer["wo"], quant.QWeight) and layer["wo"].q.ndim == (4 if scan else 3)
    if kind == "gptoss":  # the experts too, stored as declared: [E, 2, F, D] and [E, D, F]
        assert [layer[n].q.shape for n in ("w_gate_up", "w_down")] == [(8, 2, 64, 64), (8, 64, 64)]
    assert_decodes_as(ref, m, model, params, rules, policy, changed_by=1e-3)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernel", "xla"])
@pytest.mark.parametrize("kind,mesh,fuse,scan", [
    ("llama", "1dev", True, False), ("qwen2", "1dev", False, True), ("gpt2", "1dev", False, True),
    ("gptoss", "1dev", False, False)])
def test_int4_decode_matches_transformers_on_dequantized_weights(kind, mesh, fuse, scan, kernels):
    """As the int8 test: prefill and decode steps on int4 weights give transformers' logits on the
    same weights dequantised (the vocabulary's and GPT-OSS's experts in int8), through the CPU
    kernel and XLA's dot."""
    rules = rules_for(mesh)
    m = tiny_hf(kind)
    ref = dequantized_reference(m, "int4")
    policy = Policy(quantize="int4", kernels=kernels, fuse_projections=fuse, scan_layers=scan,
                    int4_activations="float32")
    model, params = to_podrun(m, rules, policy=policy)
    layer = params["layer_stack"][0] if scan else params["layers"][0]
    assert isinstance(layer["wo"], quant.Q4Weight)
    if kind == "gptoss":
        assert isinstance(layer["w_down"], quant.QWeight)
    assert_decodes_as(ref, m, model, params, rules, policy, changed_by=1e-2)


@pytest.mark.parametrize("kind,fuse", [("llama", True), ("qwen2", False), ("gpt2", False)])
def test_int4_prompts_in_bfloat16_match_transformers_rounding_the_same(kind, fuse):
    """With precision.int4_activations=bfloat16 on a CPU with AVX-512 BF16, a prompt's int4
    products (of any row count: batch invariant) round x and W to bfloat16: the logits of every
    position equal transformers' with the same roundings, and differ from the float32 products'
    (on these tiny random models any change of a weight moves the logits a lot, int4's own far
    more than bfloat16's)."""
    rules = rules_for("1dev")
    m = tiny_hf(kind)
    B, P = 4, 12
    seqs = np.random.RandomState(7).randint(0, VOCAB, (B, P)).astype(np.int32)
    logits = {}
    for how in ("float32", "bfloat16"):
        policy = Policy(quantize="int4", fuse_projections=fuse, int4_activations=how)
        assert policy.on(rules).backend.int4_bf16_rows == (min(cpu.bf16_rows(), 1) if how == "bfloat16" else 0)
        model, params = to_podrun(m, rules, policy=policy)
        logits[how] = np.stack(prompt_logits(model, params, rules, policy, seqs))
    if not cpu.bf16_rows():  # this CPU has no AVX-512 BF16: the products stay float32
        np.testing.assert_array_equal(logits["bfloat16"], logits["float32"])
        return
    ref = dequantized_reference(m, "int4", bfloat16=True)
    want = np.stack([hf_logits(ref, seqs[b: b + 1])[0] for b in range(B)])
    err = {how: np.abs(x - want) for how, x in logits.items()}
    # a float32 sum that lands a value on the other side of a bfloat16 rounding moves a few logits
    # by about 1e-2; the float32 products' are off everywhere
    assert err["bfloat16"].max() < 3e-2 and err["bfloat16"].mean() < 1e-3
    assert err["float32"].mean() > 5e-3


def test_windows_predict_every_token_once():
    from runner.tools.perplexity import windows

    ids = list(range(100, 1100))
    for max_tokens, window in [(999, 64), (50, 7), (10, 100), (999, 2)]:
        win = windows(ids, max_tokens, window)
        predicted = [int(t) for row in win for t, prev in zip(row[1:], row[:-1]) if t >= 0]
        assert predicted == ids[1: max_tokens + 1]
        assert all(row[0] >= 0 for row in win)


def hf_window_nll(m, win: np.ndarray) -> float:
    """transformers' summed negative log-likelihood over the windows, each its own context."""
    total = 0.0
    for row in win:
        row = row[row >= 0]
        with torch.no_grad():
            out = m(torch.from_numpy(row[None]), labels=torch.from_numpy(row[None]))
        total += float(out.loss) * (len(row) - 1)
    return total


def test_perplexity_nll_matches_transformers():
    """runner.tools.perplexity's negative log-likelihood over windows equals transformers' loss on the
    same windows (each window its own context), for float32 weights and for int8 ones."""
    from types import SimpleNamespace

    from runner.tools.perplexity import nll, windows

    rules = rules_for("data2_model4")
    m = tiny_hf("llama")
    ids = np.random.RandomState(5).randint(0, VOCAB, 300).tolist()
    win = windows(ids, 250, 40)
    want = {"none": hf_window_nll(m, win), "int8": hf_window_nll(dequantized_reference(m), win)}
    model, params = to_podrun(m, rules, prepare=False)
    for quantize in ("none", "int8"):
        p = quant.quantize(model.declare(), params, rules) if quantize == "int8" else params
        s = SimpleNamespace(policy=Policy(quantize=quantize), generation=SimpleNamespace(page_size=16))
        total, count = nll(s, SimpleNamespace(model=model), rules, p, win)
        assert count == 250
        np.testing.assert_allclose(total, want[quantize], rtol=1e-5)
    assert want["int8"] != want["none"]


# GPT-OSS through the kernel with its layers scanned and through XLA unscanned; the other two
# pairings under -m slow.
@pytest.mark.parametrize("kind,mesh,scan,kernels", [
    ("llama", "data2_model4", False, True), ("llama", "data2_model4", False, False),
    ("gptoss", "expert2_model2_data2", True, True), ("gptoss", "expert2_model2_data2", False, False),
    pytest.param("gptoss", "expert2_model2_data2", False, True, marks=pytest.mark.slow),
    pytest.param("gptoss", "expert2_model2_data2", True, False, marks=pytest.mark.slow)],
    ids=["llama-kernel", "llama-xla", "gptoss-scanned-kernel", "gptoss-xla", "gptoss-kernel",
         "gptoss-scanned-xla"])
def test_int8_kv_cache_decodes_close_to_transformers(kind, mesh, scan, kernels):
    """An int8 cache (one scale per slot and head) through prefill and 12 decode steps, past
    GPT-OSS's window: every step's logits stay within 20% of their spread of transformers'
    float32 ones, and the cache really holds int8. Every key is read back from its int8 page, the
    step's own too. Measured: under 10% for llama and scanned GPT-OSS, 16% for GPT-OSS (head_dim
    16, weights of std 0.3): these tiny models' noisy weights amplify the cache's rounding, which
    scatters from step to step rather than growing; the kernel and XLA agree to 1e-6. The real-model check
    is SmolLM2's perplexity through the cache (test_smollm2)."""
    rules = rules_for(mesh)
    # scanned: 2 periods of 2 layers, the weights' noise lowered (0.3 over 4 layers amplified the
    # cache's rounding to 15% of the spread, scanned or not; 0.2 gives 3%)
    m = tiny_hf(kind, std=0.2, num_hidden_layers=4) if scan else tiny_hf(kind)
    if kind == "gptoss":  # decisive routing: a near-tie between experts would flip on any rounding
        with torch.no_grad():
            for layer in m.model.layers:
                layer.mlp.router.bias[:2] += 50.0
    policy = Policy(kv_cache="int8", kernels=kernels, scan_layers=scan)
    model, params = to_podrun(m, rules, policy=policy)
    steps = 12
    lengths, seqs, got, cache = decode_logits(model, params, rules, policy, 4, steps)
    assert cache.k[0].dtype == jnp.int8 and cache.k_scale[0].shape == cache.k[0].shape[:-1]
    got = got[1:]  # the decode steps
    worst = 0.0
    for b, n in enumerate(lengths):
        want = hf_logits(m, seqs[b: b + 1, : n + steps])[0]
        for i in range(steps):
            ref = want[n + i]
            err = np.abs(got[i][b] - ref).max() / (ref.max() - ref.min())
            worst = max(worst, err)
    assert 0 < worst < 0.2, worst


def test_chunked_perplexity_is_the_whole_windows_with_sliding_windows():
    """GPT-OSS (window 8 on every other layer, sinks): windows of 20 tokens fed in chunks of 5,
    each reading the earlier ones from the pages, give transformers' loss on the same windows."""
    from types import SimpleNamespace

    from runner.tools.perplexity import nll, windows

    rules = rules_for("1dev")
    m = tiny_hf("gptoss")
    model, params = to_podrun(m, rules)
    ids = np.random.RandomState(2).randint(0, VOCAB, 50).tolist()
    win = windows(ids, 40, 20)
    s = SimpleNamespace(policy=Policy(), generation=SimpleNamespace(page_size=4))
    total, count = nll(s, SimpleNamespace(model=model), rules, params, win, 5)
    assert count == 40
    np.testing.assert_allclose(total, hf_window_nll(m, win), rtol=1e-5)


def test_int8_gptoss_decodes_one_row_as_transformers_on_dequantized_weights():
    """Batch 1: decode gathers each token's experts (the path for few assignments) from int8
    weights; greedy tokens equal transformers' on the same weights dequantised."""
    from runner.engine import Engine, Request, generate
    from tests.reference import hf_greedy

    rules = rules_for("1dev")
    m = tiny_hf("gptoss", seed=7)
    ref = dequantized_reference(m)
    policy = Policy(quantize="int8")
    model, params = to_podrun(m, rules, policy=policy)
    engine = Engine(model, params, rules, policy, batch_size=1,
                    max_prompt_len=16, max_new_tokens=16, page_size=16)
    prompt = tuple(int(t) for t in np.random.RandomState(9).randint(0, VOCAB, 11))
    got = generate(engine, [Request(prompt, 16)])[0].token_ids
    assert got == hf_greedy(ref, prompt, 16)
    assert got != hf_greedy(m, prompt, 16)  # the int8 weights change the tokens
