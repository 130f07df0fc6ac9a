"""Any converted checkpoint on this CPU, 8 simulated devices, data parallel.

    python -m runner.main --config=configs/cpu.py:/path/to/checkpoint \
        --config.io.input=requests.jsonl --config.io.output=results.jsonl

The architecture comes from the checkpoint's own metadata. Shard heads too with
--config.mesh.data=2 --config.mesh.model=4.
"""

from configs.base import base_config


def get_config(arg: str = ""):
    c = base_config()
    c.checkpoint.path = arg
    return c
