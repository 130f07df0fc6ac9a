"""GPT-OSS-20B on a TPU v5e-8 slice (2x4, 16 GiB HBM per chip): experts over 4 chips, heads and
expert hidden units over 2.

    python -m runner.main --config=configs/gptoss_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-20b \
        --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl

Convert the HF checkpoint first (MXFP4 experts are dequantised to bf16):
    python -m runner.convert --source=gpt-oss-20b/ --output=gs://BUCKET/gpt-oss-20b --dtype=bfloat16
Fit, from the declarations (python -m runner.memory --config=configs/gptoss_v5e.py): 6.1 GiB of
weights + 1.6 GiB of KV cache per chip at batch 64 and 2k tokens (48% of HBM).
Compiled for v5e:2x4 on a CPU (python -m runner.compile --config=configs/gptoss_v5e.py, 4 min on
2 cores): peak 12.4 GiB per chip (77% of HBM) for prefill_1024 with prefill_rows=4 and the Pallas
flash prefill (all 64 rows at once: 14.6 GiB; with XLA's attention they would need 24.8 GiB of
temporaries), 8.0 GiB (50%) for decode.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "gs://BUCKET/gpt-oss-20b"
    c.checkpoint.model = "gptoss:20b"
    c.mesh.update(data=1, expert=4, model=2, sequence=1, num_cpu_devices=0, device_memory_gib=16.0,
                  tpu_topology="v5e:2x4")
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default")
    c.generation.update(batch_size=64, max_prompt_len=1024, max_new_tokens=1024,
                        prefill_rows=4)
    return c
