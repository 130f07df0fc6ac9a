"""Any converted checkpoint on this CPU, on one device.

    python -m runner.main --config=configs/cpu.py:/path/to/checkpoint \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl
    python -m runner.main --config=configs/cpu.py:/path/to/checkpoint:mesh8 ...  # 8 simulated devices

The architecture comes from the checkpoint's own metadata. One device is the fast path on a CPU
(podrun's CPU kernels for the float32 projections and the greedy screen apply to a one-device
mesh only, and 8 data-parallel devices hold 8 copies of the weights). `:mesh8` runs the same job over 8
simulated devices, data parallel, as a pod slice would; shard heads too with
--config.mesh.data=2 --config.mesh.model=4.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    # The variant is the last ":"-separated field, so that a path may hold ":" (gs://...).
    path, _, variant = arg.rpartition(":")
    if variant != "mesh8":
        path, variant = arg, ""
    c = base_config()
    c.checkpoint.path = path
    c.mesh.num_cpu_devices = 8 if variant else 1  # mesh.data=-1 fills the devices
    return c
