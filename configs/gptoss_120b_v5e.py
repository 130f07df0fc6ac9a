"""GPT-OSS-120B on a TPU v5e-32 slice (4x8, 16 GiB HBM per chip): 128 experts over 8 chips and
their hidden units over 4; heads over 4; the vocabulary over all 32.

    python -m runner.main --config=configs/gptoss_120b_v5e.py --config.checkpoint.path=gs://BUCKET/gpt-oss-120b \
        --config.io.input=gs://BUCKET/requests.jsonl --config.io.output=gs://BUCKET/results.jsonl

Fit, from the declarations (python -m runner.tools.memory --config=configs/gptoss_120b_v5e.py
--mean_tokens=3000): 7.2 GiB of weights + a pool of 4.5 GiB of 16-token pages per chip (471k
tokens: 128 rows of 3,700 on average), 73% of HBM.
Compiled for v5e:4x8 on a CPU (python -m runner.tools.compile --config=configs/gptoss_120b_v5e.py): the
four programs a job runs (mixed_16, mixed_64, mixed_256, decode_8) peak at 11.9-12.0 GiB per chip
(75% of HBM), 0.07-0.09 GiB of it temporaries.
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
    # Pages of 16 tokens in a pool of 4.5 GiB a chip: 128 rows decoded together, each holding the
    # tokens it has (a mean of about 3,700 each before any is preempted; attention is repeated by
    # the 8 expert shards, so a token's keys and values cost a chip 3x the 20B's).
    c.generation.update(batch_size=128, max_prompt_len=4096, max_new_tokens=16384,
                        kv_cache_gib=4.5)
    return c
