"""GPT-OSS-20B in bfloat16 on one NVIDIA H100 (80 GB): the MoE's experts dequantised from MXFP4.

    python -m runner.main --config=configs/gptoss_h100.py --config.checkpoint.path=/data/gpt-oss-20b \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl

Install jax's CUDA plugin beside podrun first (pip install -r requirements-gpu.txt), and convert
the HF checkpoint once (the MXFP4 experts become bfloat16):
    python -m runner.tools.convert --source=gpt-oss-20b/ --output=/data/gpt-oss-20b --dtype=bfloat16

Fit (python -m runner.tools.memory --config=configs/gptoss_h100.py --mean_tokens=3000): 39 GiB of
weights and a pool of 28 GiB of 16-token pages (1.1M tokens: 256 rows of 4,400 on average; the
sliding-window layers keep a pool of their own holding each row's 128-token window), 84% of the
card before activations. The engine (docs/paged-engine.md) decodes up to 256 rows a step
beside a chunk of up to 256 prompt tokens; attention over the pages is XLA's, or with
--config.kernels.pallas_attention=True a Triton kernel (off until timed on a GPU). The experts
run as XLA's dense products over buckets of routed tokens; the Pallas grouped matmul
(kernels.pallas_moe) is a TPU kernel. The layers are unrolled, as
configs/llama3_h100.py explains. Not yet measured on a GPU: benchmarks/gpu_check.py's gptoss step.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "~/.cache/podrun/checkpoints/gpt-oss-20b"
    c.checkpoint.model = "gptoss:20b"
    c.mesh.update(data=1, model=1, num_cpu_devices=0, device_memory_gib=80.0)
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16",
                       matmul="default")
    # Pages of 16 tokens in a pool of 28 GiB beside 39 GiB of weights: 256 rows decoded together,
    # each holding the tokens it has (a mean of about 4,400 before any is preempted).
    c.generation.update(batch_size=256, max_prompt_len=4096, max_new_tokens=16384,
                        kv_cache_gib=28.0)
    return c
