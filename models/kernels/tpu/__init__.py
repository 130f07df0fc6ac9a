"""Pallas TPU kernels, with kernels.enabled, a kernel a module: the engine's paged_attention
(attention.py) and write_pages (writes.py) over pools stored folded (common.py, models/paged.py),
and GPT-OSS's experts on v5e and v6e (moe.py). Checked on CPU in interpret mode against numpy
(tests/test_kernels.py) and compiled for TPU v5e ahead of time (tests/test_compile.py,
python -m runner.tools.compile). models/backend.py chooses them through this package's names.
"""

from models.kernels.tpu.attention import paged_attention, ragged_paged_attention
from models.kernels.tpu.common import fold
from models.kernels.tpu.moe import EXPERTS_VMEM_BYTES, experts, experts_vmem_bytes
from models.kernels.tpu.writes import write_pages

__all__ = ["EXPERTS_VMEM_BYTES", "experts", "experts_vmem_bytes", "fold", "paged_attention",
           "ragged_paged_attention", "write_pages"]
