"""GPT-OSS-120B on a TPU v5e-32 slice (4x8, 16 GiB HBM per chip): 128 experts over 8 chips and
their hidden units over 4; heads over 4; the vocabulary over all 32.

    python -m runner.main --config=configs/gptoss_120b_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-120b \
        --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl

Fit, from the declarations (python -m runner.tools.memory --config=configs/gptoss_120b_v5e.py): 7.2 GiB
of weights + 1.2 GiB of KV cache per chip at batch 64 and 2k tokens (53% of HBM).
Compiled for v5e:4x8 on a CPU (python -m runner.tools.compile --config=configs/gptoss_120b_v5e.py, 5 min
on 2 cores): peak 12.9 GiB per chip (81% of HBM) for prefill_1024 with prefill_rows=4 and the
Pallas flash prefill, 8.7 GiB (54%) for decode.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "gs://BUCKET/gpt-oss-120b"
    c.checkpoint.model = "gptoss:120b"
    c.mesh.update(data=1, expert=8, model=4, sequence=1, num_cpu_devices=0, device_memory_gib=16.0,
                  tpu_topology="v5e:4x8")
    # The vocabulary over all 32 chips (the 8 kv heads cannot be split 32 ways: attention keeps
    # heads over 4 and is repeated by the 8 expert shards).
    c.rules.update(vocab="model,expert", act_vocab="model,expert")
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default")
    c.generation.update(batch_size=64, max_prompt_len=1024, max_new_tokens=1024,
                        prefill_rows=4)
    return c
