"""Llama-3.1-8B in bfloat16 on one NVIDIA H100 (80 GB).

    python -m runner.main --config=configs/llama3_h100.py --config.checkpoint.path=/data/llama-3.1-8b \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl

Install jax's CUDA plugin beside podrun first (pip install -r requirements-gpu.txt), and convert
the HF checkpoint once:
    python -m runner.tools.convert --source=Llama-3.1-8B-Instruct/ --output=/data/llama-3.1-8b --dtype=bfloat16

On a machine of several GPUs, --config.mesh.data=8 runs a replica on each (the weights fit one
card), or --config.mesh.model=2 splits heads and the MLP over two. Nothing TPU- or CPU-only runs
here: models/backend.py chooses the kernels once per mesh, and XLA compiles the rest for the GPU.

Fit (python -m runner.tools.memory --config=configs/llama3_h100.py): 15.0 GiB of weights and 32 GiB of
KV cache for 128 rows of 1,024 prompt + 1,024 new tokens, 59% of the card before activations.
Prefill takes 8 prompts at a time, and its attention runs in cuDNN's flash kernel, which keeps
the [T, T] scores out of memory. The layers are unrolled: scanned (programs.scan_layers),
XLA:GPU's decode step ran 2.4x slower, as if it copied each layer's weights out of the stack.
Each program then takes 15-22 s to compile; the compilation cache keeps them for the next run.
Decode attention is XLA's, which reads every slot of every row's cache on each step;
--config.kernels.pallas_attention=True reads each row only up to its last token, in a Pallas
(Triton) kernel not yet measured on a GPU (benchmarks/gpu_check.py's decode_kernel step).
On an H100: batch-1 decode 6.46 ms a step, 99% of the measured bandwidth
(docs/benchmarks/gpu-h100.md, benchmarks/gpu_check.py).
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "~/.cache/podrun/checkpoints/llama-3.1-8b"
    c.checkpoint.model = "llama:llama3.1-8b"
    c.mesh.update(data=1, model=1, num_cpu_devices=0, device_memory_gib=80.0)
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16",
                       matmul="default")
    c.kernels.cudnn_prefill = True
    c.generation.update(batch_size=128, max_prompt_len=1024, max_new_tokens=1024, prefill_rows=8,
                        prefill_buckets=(128, 256, 512, 1024))
    return c
