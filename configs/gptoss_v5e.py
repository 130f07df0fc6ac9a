"""GPT-OSS-20B on a TPU v5e-8 slice (2x4, 16 GiB HBM per chip): experts over 4 chips and their
hidden units over 2; attention heads, the KV cache and the vocabulary over all 8.

    python -m runner.main --config=configs/gptoss_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-20b \
        --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl

Convert the HF checkpoint first (MXFP4 experts are dequantised to bf16):
    python -m runner.tools.convert --source=gpt-oss-20b/ --output=gs://BUCKET/gpt-oss-20b --dtype=bfloat16

Fit, from the declarations (python -m runner.tools.memory --config=configs/gptoss_v5e.py
--mean_tokens=3000): 4.9 GiB of weights + a pool of 6 GiB of 16-token pages per chip (2.0M tokens:
256 rows of 7,800 on average; the sliding-window layers keep a pool of their own holding each
row's 128-token window), 68% of HBM. With heads and the vocabulary over model alone, the 4
expert shards would each hold the same half of every page and of the vocabulary.
Compiled for v5e:2x4 on a CPU (python -m runner.tools.compile --config=configs/gptoss_v5e.py): the
four programs a job runs (mixed_16, mixed_64, mixed_256: 256 decoding rows beside a prompt's chunk;
decode_8) peak at 11.0-11.1 GiB per chip (69% of HBM), 0.05-0.08 GiB of it temporaries.
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
    # Pages of 16 tokens in a pool of 6 GiB a chip: 256 rows decoded together, each holding the
    # tokens it has (a mean of about 7,800 each before any is preempted), so a reasoning job's
    # 16k-token limit costs the short answers nothing.
    c.generation.update(batch_size=256, max_prompt_len=4096, max_new_tokens=16384,
                        kv_cache_gib=6.0)
    return c
