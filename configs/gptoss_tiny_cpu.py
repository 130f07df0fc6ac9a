"""A tiny random GPT-OSS (MoE, sinks, sliding windows, the o200k_harmony vocabulary) end to end
on this CPU with 8 simulated devices: experts over 2, heads over 2, batch over 2.

    python -m runner.main --config=configs/gptoss_tiny_cpu.py

The weights are random (initialised once into ~/.cache/podrun/checkpoints/gptoss-tiny-o200k), so
the answers are noise; the point is the whole path: Harmony rendering, MoE on an expert-sharded
mesh, sliding windows over pages, stopping on <|return|>/<|call|>, and channel parsing that flags garbled output.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    del arg
    c = base_config()
    c.checkpoint.path = "~/.cache/podrun/checkpoints/gptoss-tiny-o200k"
    c.checkpoint.fetch = "random:gptoss:tiny-o200k"
    c.checkpoint.model = "gptoss:tiny-o200k"
    c.mesh.update(data=2, expert=2, model=2)
    c.generation.update(batch_size=4, max_prompt_len=256, max_new_tokens=32)
    c.io.input = "configs/prompts/harmony.jsonl"
    c.io.output = "out/gptoss_tiny.jsonl"
    return c
