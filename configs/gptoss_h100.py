"""GPT-OSS-20B in bfloat16 on one NVIDIA H100 (80 GB): the MoE's experts dequantised from MXFP4.

    python -m runner.main --config=configs/gptoss_h100.py --config.checkpoint.path=/data/gpt-oss-20b \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl

Install jax's CUDA plugin beside podrun first (pip install -r requirements-gpu.txt), and convert
the HF checkpoint once (the MXFP4 experts become bfloat16):
    python -m runner.tools.convert --source=gpt-oss-20b/ --output=/data/gpt-oss-20b --dtype=bfloat16

Fit (python -m runner.tools.memory --config=configs/gptoss_h100.py): 39 GiB of weights and 3 GiB of
KV cache for 64 rows of 1,024 prompt + 1,024 new tokens (half the layers keep a 128-token
window), 53% of the card before activations. The experts run as XLA's dense products over
buckets of routed tokens; the Pallas grouped matmul (kernels.pallas_moe) is a TPU kernel.
Prefill attention stays XLA's (cuDNN's flash kernel has no sinks); decode attention is XLA's too
unless kernels.pallas_attention (the Triton kernel takes sinks and windows). The layers are
unrolled, as configs/llama3_h100.py explains. Not yet measured on a GPU: benchmarks/gpu_check.py's
gptoss step.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "~/.cache/podrun/checkpoints/gpt-oss-20b"
    c.checkpoint.model = "gptoss:20b"
    c.mesh.update(data=1, model=1, num_cpu_devices=0, device_memory_gib=80.0)
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16",
                       matmul="default")
    c.generation.update(batch_size=64, max_prompt_len=1024, max_new_tokens=1024, prefill_rows=4,
                        prefill_buckets=(128, 256, 512, 1024))
    return c
