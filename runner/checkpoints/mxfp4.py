"""MXFP4 expert weights (gpt-oss's `<name>_blocks` + `<name>_scales`) dequantised to bfloat16 or
float32 under `<name>`, in the layout of transformers' unquantised model. Reference:
transformers' integrations/mxfp4.py.
"""

from __future__ import annotations

import concurrent.futures
import os

import ml_dtypes
import numpy as np

from runner.checkpoints.source import SourceError

# OCP microscaling FP4 (e2m1) by nibble; the high bit is the sign.
_FP4_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
# byte -> (its low nibble's value, its high nibble's): the low nibble is the earlier element
_FP4_PAIRS = np.stack([_FP4_E2M1[np.arange(256) & 15], _FP4_E2M1[np.arange(256) >> 4]], axis=-1)
EXPERT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
_MXFP4_CHUNK = 1 << 24  # values per chunk: 64 MB of float32 in flight per thread


def dequantise(tensors: dict[str, np.ndarray], origin: dict[str, str], dtype) -> None:
    """Replaces each MXFP4 pair `<name>_blocks` [E, R, G, 16] uint8 (32 FP4 values per block,
    two per byte) + `<name>_scales` [E, R, G] uint8 (e8m0, bias 127) by `<name>` [E, G*32, R],
    in place: the values of block (e, r, g) are row r's columns g*32..g*32+31, and the result is
    transposed like transformers' convert_moe_packed_tensors, giving GptOssExperts' gate_up_proj
    [E, D, 2F] (gate/up interleaved on the last axis as stored) and down_proj [E, F, D]."""
    for scales_name in [n for n in tensors if n.endswith("_scales")]:
        if (blocks_name := scales_name.removesuffix("_scales") + "_blocks") not in tensors:
            raise SourceError(f"{origin[scales_name]}: MXFP4 tensor {scales_name} has no "
                              f"{blocks_name} beside it in the folder")
    for blocks_name in [n for n in tensors if n.endswith("_blocks")]:
        name = blocks_name.removesuffix("_blocks")
        blocks, file = tensors.pop(blocks_name), origin[blocks_name]
        if (scales := tensors.pop(f"{name}_scales", None)) is None:
            raise SourceError(f"{file}: MXFP4 tensor {blocks_name} has no {name}_scales beside it "
                              "in the folder")
        where = f"{file}: MXFP4 tensor {name}"
        if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
            raise SourceError(f"{where}: _blocks is {blocks.dtype} and _scales {scales.dtype}; "
                              "both must be uint8 (U8)")
        if blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
            raise SourceError(f"{where}: _blocks {list(blocks.shape)} and _scales "
                              f"{list(scales.shape)} do not pair; expected [experts, rows, "
                              "blocks, 16] and [experts, rows, blocks]")
        bias = tensors.get(f"{name}_bias")
        if bias is not None and bias.shape != blocks.shape[:2]:
            raise SourceError(f"{where}: {name}_bias is {list(bias.shape)}, but the blocks hold "
                              f"{list(blocks.shape[:2])} experts x rows")
        if name in tensors:
            raise SourceError(f"{where}: present both unquantised and as _blocks/_scales")
        tensors[name] = _mxfp4_experts(blocks, scales, dtype, where)


def _mxfp4_experts(blocks: np.ndarray, scales: np.ndarray, dtype, where: str) -> np.ndarray:
    """[E, R, G, 16] blocks and [E, R, G] scales -> [E, G*32, R], a few experts at a time on a
    few threads (numpy lets go of the GIL). FP4 values (2 significant bits) times 2^(scale-127)
    are exact in float32 and bfloat16 from 0.5 * 2^-127 (a subnormal) up; from 4 * 2^126
    (scale 253) they overflow, and scale 255 is NaN: both are refused, where transformers would
    give inf and NaN."""
    n_experts, rows, groups, _ = blocks.shape
    out = np.empty((n_experts, groups * 32, rows), dtype)
    step = max(1, _MXFP4_CHUNK // max(1, rows * groups * 32))

    def chunk(e: int) -> None:
        exponent = scales[e:e + step].astype(np.int32) - 127  # [e, R, G]
        values = np.take(_FP4_PAIRS, blocks[e:e + step], axis=0)  # [e, R, G, 16, 2] float32
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are caught below
            values *= np.ldexp(np.float32(1), exponent)[..., None, None]
        if exponent.max(initial=-127) >= 126 and not np.isfinite(values).all():
            raise SourceError(f"{where}: experts {e}..{e + len(exponent) - 1} hold values beyond "
                              "float32/bfloat16 range (e8m0 scales 253 and up with large FP4 "
                              "codes, or 255, which is NaN); the checkpoint is corrupt")
        values = values.reshape(len(exponent), rows, groups * 32).astype(dtype, copy=False)
        out[e:e + step] = values.transpose(0, 2, 1)  # cast first: a transposed cast is slower

    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(chunk, range(0, n_experts, step)))  # re-raises a chunk's SourceError
    return out
