"""Model numerics against transformers, on several meshes."""

import jax
import numpy as np
import pytest

from models.policy import Policy
from tests.conftest import rules_for
from tests.forward import Rows, prompt_logits
from tests.reference import VOCAB, hf_logits, ragged_batch, tiny_hf, to_podrun

KINDS = ["llama", "llama3", "qwen2", "gpt2"]


FUSED = [(k, False) for k in KINDS] + [(k, True) for k in KINDS if k != "gpt2"]  # gpt2 is fused as released


@pytest.mark.parametrize("kind,fuse", FUSED, ids=[f"{k}-{'fused' if f else 'separate'}" for k, f in FUSED])
def test_logits_match_transformers(kind, fuse, mesh_rules):
    m = tiny_hf(kind)
    model, params = to_podrun(m, mesh_rules, fuse)
    assert ("wqkv" in params["layers"][0]) == (fuse or kind == "gpt2")
    tokens = np.random.RandomState(1).randint(0, VOCAB, (8, 40)).astype(np.int32)
    logits = prompt_logits(model, params, mesh_rules, Policy(), tokens)
    np.testing.assert_allclose(np.stack(logits), hf_logits(m, tokens), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gptoss"])
def test_panels_hold_the_projections_on_one_cpu_device(kind):
    """kernels.panel_weights: on one CPU device every projection but the vocabulary's tables and
    GPT-OSS's experts is packed, each panel numpy's 64 columns of the weight as [C, O] (zero
    columns past O), as abstract_params declares them; on a mesh of several devices, or with
    panel_weights off, nothing is."""
    from models.panels import PanelWeight

    m = tiny_hf(kind)
    _, raw = to_podrun(m, rules_for("1dev"), prepare=False)
    raw = jax.tree.map(np.asarray, raw)
    model, held = to_podrun(m, rules_for("1dev"))
    abstract = model.abstract_params(rules_for("1dev"), Policy())  # what an AOT compile is given
    assert jax.tree.structure(abstract) == jax.tree.structure(held)
    assert ([(a.shape, a.dtype) for a in jax.tree.leaves(abstract)]
            == [(x.shape, x.dtype) for x in jax.tree.leaves(held)])
    layer = held["layers"][0]
    assert not isinstance(held["embed"], PanelWeight)
    if kind == "gptoss":
        assert not any(isinstance(layer[n], PanelWeight) for n in ("w_gate_up", "w_down"))
    for name, contract in [("wq", 1), ("wk", 1), ("wo", 2)]:
        w = raw["layers"][0][name]
        C = int(np.prod(w.shape[:contract]))
        matrix = w.reshape(C, -1)
        O = matrix.shape[1]
        want = np.zeros((-(-O // 64), C, 64), np.float32)
        for p in range(want.shape[0]):
            want[p, :, :min(64, O - 64 * p)] = matrix[:, 64 * p:64 * (p + 1)]
        assert isinstance(layer[name], PanelWeight) and layer[name].out_shape == w.shape[contract:]
        np.testing.assert_array_equal(np.asarray(layer[name].panels), want)
    for rules, policy in ((rules_for("data8"), None), (rules_for("1dev"), Policy(panel_weights=False))):
        _, params = to_podrun(m, rules, policy=policy)
        assert not any(isinstance(x, PanelWeight) for x in jax.tree.leaves(
            params, is_leaf=lambda x: isinstance(x, PanelWeight)))


@pytest.mark.parametrize("kind,fuse", [("llama", False), ("llama", True), ("gpt2", False)])
def test_decode_matches_full_forward(kind, fuse, mesh_rules):
    """Ragged prompts prefilled in chunks of 5 (pages of 4), then decoded one token at a time
    through the pages: every step's logits equal transformers' over the whole sequence."""
    m = tiny_hf(kind)
    model, params = to_podrun(m, mesh_rules, fuse)
    B, P, steps = 8, 16, 6
    lengths, seqs = ragged_batch(2, B, P, steps, shortest=3)
    rows = Rows(model, params, mesh_rules, Policy(), B, P + steps)
    prompts = rows.prefill([seqs[b, :n] for b, n in enumerate(lengths)], chunk=5)
    got = [np.stack([p[-1] for p in prompts])]
    for i in range(steps):
        got.append(rows.step([seqs[b, n + i] for b, n in enumerate(lengths)]))
    for b, n in enumerate(lengths):
        ref = hf_logits(m, seqs[b : b + 1, : n + steps])[0]
        np.testing.assert_allclose(prompts[b], ref[:n], atol=2e-4, rtol=1e-4)
        for i in range(steps + 1):
            np.testing.assert_allclose(got[i][b], ref[n - 1 + i], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,fuse", [("llama", False), ("llama3", True), ("qwen2", False),
                                       ("gpt2", False)])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_decode_in_the_cpu_product_kernel_matches_transformers(kind, fuse, B):
    """On one CPU device the engine's policy (Policy.on) sends a decode step's projections of up
    to eight rows to podrun's float32 product kernel (untied unembedding [D, V] and tied [V, D]
    alike); its logits step by step against transformers, and the kernel really in the program."""
    rules = rules_for("1dev")
    policy = Policy().on(rules)
    assert policy.backend.product_kernel and not Policy().on(rules_for("data8")).backend.product_kernel
    m = tiny_hf(kind)
    model, params = to_podrun(m, rules, fuse)
    seqs = np.random.RandomState(3).randint(0, VOCAB, (B, 10)).astype(np.int32)
    P, steps = 6, 4
    rows = Rows(model, params, rules, policy, B, P + steps)
    rows.prefill(seqs[:, :P])
    assert "podrun_matmul_f32" in rows.step_hlo(seqs[:, P])
    ref = hf_logits(m, seqs)
    for i in range(steps):
        np.testing.assert_allclose(rows.step(seqs[:, P + i]), ref[:, P + i], atol=2e-4, rtol=1e-4)
