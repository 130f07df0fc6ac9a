"""Tiny random transformers models, and transformers' own load of a GGUF: the independent
references the tests compare against."""

import os
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from models.policy import Policy
from models.registry import Model
from models.weights import shardings
from sharding.rules import Rules

VOCAB = 128


def tiny_hf(kind: str, seed: int = 0, std: float = 0.3, **overrides):
    """A random transformers model (eval mode) with weights noisy enough for decisive greedy picks;
    `overrides` change its config (num_hidden_layers=4, vocab_size=..., ...; not GPT-2's)."""
    if overrides and kind == "gpt2":
        raise ValueError("config overrides are not for gpt2")
    torch.manual_seed(seed)
    common = {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256),
              **({} if kind == "gptoss" else overrides)}
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        m = transformers.LlamaForCausalLM(cfg)
    elif kind == "llama3":  # Llama 3.1 RoPE scaling, attention and MLP biases
        cfg = transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True, rope_theta=50000.0,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32})
        m = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        m = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=8, n_positions=256,
                                      bos_token_id=0, eos_token_id=0)
        m = transformers.GPT2LMHeadModel(cfg)
    elif kind == "gptoss":  # 8 experts, top-2, sliding window 8 on even layers, random sinks
        cfg = transformers.GptOssConfig(**{
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8,
            "max_position_embeddings": 256, "attn_implementation": "eager", **overrides})
        m = transformers.GptOssForCausalLM(cfg)
    else:
        raise ValueError(kind)
    m.eval()
    m.generation_config.eos_token_id = None  # never stop early, nor suppress any id
    m.generation_config.bos_token_id = None
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * std)
    return m


def to_podrun(m, rules: Rules, fuse: bool = False, policy: Policy | None = None,
              prepare: bool = True):
    """The transformers model's weights mapped through podrun's own name mapping, sharded, and
    (unless not `prepare`: as restored) prepared as a deployment's load does
    (models/registry.Model.prepare) for `policy`, by default Policy(fuse_projections=fuse): on one
    CPU device the projections go into panels (models/panels.py)."""
    model = Model.from_hf_config(m.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    params = model.module.from_hf(sd, model.config)
    params = jax.device_put(jax.tree.map(jnp.asarray, params), shardings(model.declare(), rules))
    if not prepare:
        return model, params
    return model, model.prepare(params, rules, policy or Policy(fuse_projections=fuse))


def ragged_batch(seed: int, B: int, P: int, steps: int, shortest: int):
    """B sequences of P + steps random tokens, sequence b's prompt its first lengths[b]
    (shortest..P) tokens: lengths [B], seqs [B, P + steps]."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(shortest, P + 1, B)
    seqs = rng.randint(0, VOCAB, (B, P + steps)).astype(np.int32)
    return lengths, seqs


def hf_greedy(m, prompt, n: int) -> list[int]:
    out = m.generate(torch.tensor([list(prompt)]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                     max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt):].tolist()


def hf_logits(m, tokens) -> np.ndarray:
    with torch.no_grad():
        return m(torch.tensor(np.asarray(tokens))).logits.numpy()


def transformers_gguf_load(path: str) -> tuple[transformers.PretrainedConfig, dict, dict]:
    """What `from_pretrained(folder, gguf_file=...)` loads (its legacy GGUF path, which serves
    llama, qwen2 and gpt2), called directly since from_pretrained wants accelerate for GGUF:
    (config, {name: float32 array}, tokenizer_config)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(os.path.dirname(path),
                                                     gguf_file=os.path.basename(path))
    with torch.device("meta"):  # only its parameter names are used, to map GGUF names
        model = transformers.AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    tensors = {k: v.float().numpy() for k, v in parsed["tensors"].items()}
    return config, tensors, parsed["tokenizer_config"]


@dataclass
class GGUFReference:
    """transformers' load of one GGUF file, done once and shared by the tests that compare against
    it (for the real SmolLM2 the load takes 20-40 s on a 2-core machine): its config, tensors and
    tokenizer config as `transformers_gguf_load` gives them, its tokenizer, and its model."""

    path: str

    @cached_property
    def loaded(self) -> tuple[transformers.PretrainedConfig, dict, dict]:
        return transformers_gguf_load(self.path)

    @cached_property
    def tokenizer(self) -> transformers.PreTrainedTokenizerBase:
        folder, name = os.path.split(self.path)
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)

    @cached_property
    def model(self) -> transformers.PreTrainedModel:
        """The float32 model from those tensors, as `from_pretrained(..., gguf_file=...)` builds it
        (for SmolLM2 the same state dict and logits as from_pretrained's, compared once by hand, not
        on every run: that load takes another 15-20 s); generation never stops at EOS."""
        config, tensors, _ = self.loaded
        m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing, unexpected = m.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()},
                                                strict=False)
        tied = ["lm_head.weight"] if config.tie_word_embeddings else []
        assert missing == tied and not unexpected, (missing, unexpected)
        m.tie_weights()
        m.generation_config.eos_token_id = None
        return m.eval()
