"""benchmarks/peer_podrun.py, podrun's adapter for the peer benchmark kit: a check that needs the
kit itself (../shared/peers beside the repository, or $PEERS_KIT), so it lives here with the
adapter, outside the project's test suite:

    python -m pytest benchmarks/test_peer_podrun.py
"""

import importlib
import json
import os
import subprocess
import sys

import torch
import transformers

from tests.reference import hf_greedy
from tests.test_end_to_end import ROOT

KIT = os.environ.get("PEERS_KIT") or os.path.join(os.path.dirname(ROOT), "shared", "peers")


def test_peer_adapter_answers_the_kit_workload_as_transformers_does(tmp_path):
    """benchmarks/peer_podrun.py on a small random Llama with the kit's 32000-id vocabulary."""
    assert os.path.exists(os.path.join(KIT, "bench_common.py")), f"no peer kit at {KIT}"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():  # decisive greedy picks
            p.add_(torch.randn_like(p) * 0.3)
    m.save_pretrained(tmp_path / "model")
    env = dict(os.environ, PEERS_HOME=str(tmp_path), PEER_MODEL=str(tmp_path / "model"), PEER_BATCHES="1,2",
               PEER_PROMPT_LEN="8", PEER_NEW_TOKENS="5", PEER_REPS="1", PEER_OUT=str(tmp_path / "out.json"))
    env.pop("XLA_FLAGS", None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "peer_podrun.py"),
                        f"--config.compilation_cache.dir={tmp_path / 'xla'}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "podrun-model" / "podrun.json").exists()
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["engine"] == "podrun-float32"
    sys.path.insert(0, KIT)
    try:
        kit = importlib.import_module("bench_common")
    finally:
        sys.path.remove(KIT)
    for r in res["results"]:
        prompts = kit.make_prompts(r["batch"], 8)
        assert r["tokens"] == [hf_greedy(m, prompt, 5) for prompt in prompts]
