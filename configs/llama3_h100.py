"""Llama-3.1-8B in bfloat16 on one NVIDIA H100 (80 GB).

    python -m runner.main --config=configs/llama3_h100.py --config.checkpoint.path=/data/llama-3.1-8b \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl

Install jax's CUDA plugin beside podrun first (pip install -r requirements-gpu.txt), and convert
the HF checkpoint once:
    python -m runner.tools.convert --source=Llama-3.1-8B-Instruct/ --output=/data/llama-3.1-8b --dtype=bfloat16

On a machine of several GPUs, --config.mesh.data=8 runs a replica on each (the weights fit one
card), or --config.mesh.model=2 splits heads and the MLP over two. Nothing TPU- or CPU-only runs
here: models/backend.py chooses the kernels once per mesh, and XLA compiles the rest for the GPU.

Fit (python -m runner.tools.memory --config=configs/llama3_h100.py --mean_tokens=3000): 15.0 GiB of
weights and a pool of 40 GiB of 16-token pages (327,680 tokens: 256 rows of 1,280 on average, or
108 rows of 3,000), 69% of the card before activations. The engine (docs/paged-engine.md)
decodes up to 256 rows a step beside a chunk of up to 256 prompt tokens; attention over the pages
is XLA's (blocks of 8 pages with a running softmax), or with --config.kernels.pallas_attention=True
a Triton kernel that reads each row's pages only (off until timed on a GPU). Not yet measured
on a GPU at this batch: benchmarks/gpu_check.py's throughput step runs this engine (256 rows,
40 GiB) on vLLM's 1,000 requests of 256 + 256 tokens.
The layers are unrolled: scanned (programs.scan_layers), XLA:GPU's decode step ran 2.4x slower,
as if it copied each layer's weights out of the stack.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg or "~/.cache/podrun/checkpoints/llama-3.1-8b"
    c.checkpoint.model = "llama:llama3.1-8b"
    c.mesh.update(data=1, model=1, num_cpu_devices=0, device_memory_gib=80.0)
    c.precision.update(params="bfloat16", activations="bfloat16", kv_cache="bfloat16",
                       matmul="default")
    # Pages of 16 tokens in a pool of 40 GiB beside 15 GiB of weights: 256 rows decoded together,
    # each holding the tokens it has (a mean of about 1,280 before any is preempted).
    c.generation.update(batch_size=256, max_prompt_len=8192, max_new_tokens=4096,
                        kv_cache_gib=40.0)
    return c
