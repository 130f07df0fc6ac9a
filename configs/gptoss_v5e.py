"""GPT-OSS-20B on a TPU v5e-8 slice (2x4, 16 GiB HBM per chip): experts over 4 chips and their
hidden units over 2; attention heads, the KV cache and the vocabulary over all 8.

    python -m runner.main --config=configs/gptoss_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-20b \
        --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl

Convert the HF checkpoint first (MXFP4 experts are dequantised to bf16):
    python -m runner.tools.convert --source=gpt-oss-20b/ --output=gs://BUCKET/gpt-oss-20b --dtype=bfloat16

Fit, from the declarations (python -m runner.tools.memory --config=configs/gptoss_v5e.py): 4.9 GiB of
weights + 0.4 GiB of KV cache per chip at batch 64 and 2k tokens (33% of HBM). With heads and the
vocabulary over model alone, the 4 expert shards each held the same half of the cache and of the
vocabulary: 6.1 + 1.6 GiB.
Compiled for v5e:2x4 on a CPU (python -m runner.tools.compile --config=configs/gptoss_v5e.py, 3.5 min
on 2 cores): peak 7.4 GiB per chip (46% of HBM) for prefill_1024 with prefill_rows=4 and the
Pallas flash prefill, 5.4 GiB (34%) for decode. All 64 rows at once (prefill_rows=0) ask for
15.8 GiB and do not fit.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "gs://BUCKET/gpt-oss-20b"
    c.checkpoint.model = "gptoss:20b"
    c.mesh.update(data=1, expert=4, model=2, sequence=1, num_cpu_devices=0, device_memory_gib=16.0,
                  tpu_topology="v5e:2x4")
    # Attention and the vocabulary over all 8 chips: the 8 kv heads one per chip, each with its 8
    # query heads, so the KV cache is split 8 ways rather than held by all 4 expert shards alike.
    heads = "model,expert"
    c.rules.update(heads=heads, kv_heads=heads, act_heads=heads, act_kv_heads=heads,
                   cache_kv_heads=heads, vocab=heads, act_vocab=heads)
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16", matmul="default")
    c.generation.update(batch_size=64, max_prompt_len=1024, max_new_tokens=1024,
                        prefill_rows=4)
    return c
